"""The shape of an engine catalog entry: the types `common/engines.py` fills in.

An `EngineEntry` gathers what gearshift knows about one serving engine, grouped by who
reads it: how the agent launches it (`LaunchFacts`, `BuildStep`) and runs its image
(`ImageFacts`), what its health endpoints say (`HealthSemantics`), where and under which
names its metrics are (`MetricEndpoint`, `MetricNames`), its capacity prior
(`CapacityPrior`) and its version table (`ReleaseRows` of `ReleaseRow`, each with its
`LaunchFlags`), which `common/engine_versions.py` resolves. The entries themselves, and
the lookups by name, are the catalog's (docs/engines.md, "What an entry holds").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class MetricFormat(StrEnum):
    """How a metric endpoint's body is written."""

    PROMETHEUS = "prometheus"                # Prometheus text exposition
    TRTLLM_ITERATIONS = "trtllm-iterations"  # trtllm-serve JSON iteration stats, drained on read


@dataclass(frozen=True)
class MetricEndpoint:
    """One HTTP path the scraper reads."""

    path: str
    format: MetricFormat
    optional: bool = False  # a 404 means "not enabled on this server", not a failure


@dataclass(frozen=True)
class MetricNames:
    """The engine's Prometheus names for each figure gearshift reads.

    Each tuple lists base names in lookup order; each is tried under every prefix in
    `prefixes` (first prefix that has it wins, so nothing is counted twice).
    `finished` counts finished requests; those whose `finished_reason` label is in
    the parser's error reasons count as errors too. `errors` names a separate counter
    of failed requests, for engines that have one instead of the label.
    """

    prefixes: tuple[str, ...]
    finished: tuple[str, ...] = ("request_success",)
    errors: tuple[str, ...] = ()
    prompt_tokens: tuple[str, ...] = ("prompt_tokens",)
    generation_tokens: tuple[str, ...] = ("generation_tokens",)
    running: tuple[str, ...] = ("num_requests_running",)
    waiting: tuple[str, ...] = ("num_requests_waiting",)
    kv_cache_usage: tuple[str, ...] = ("kv_cache_usage_perc",)  # a fraction in [0, 1]
    ttft: tuple[str, ...] = ("time_to_first_token_seconds",)
    itl: tuple[str, ...] = ("inter_token_latency_seconds",)
    e2e: tuple[str, ...] = ("e2e_request_latency_seconds",)
    # The signals an SLA policy reads (empty: the engine does not export it).
    queue_time: tuple[str, ...] = ()            # histogram, seconds waiting before scheduling
    preemptions: tuple[str, ...] = ()           # counter of preempted (retracted) requests
    # Prefix-cache counters: hits and either queries (hits + misses) or misses, in the
    # engine's unit (tokens or KV-cache blocks); their ratio is the hit rate.
    prefix_cache_hits: tuple[str, ...] = ()
    prefix_cache_queries: tuple[str, ...] = ()
    prefix_cache_misses: tuple[str, ...] = ()
    prefix_cache_hit_rate: tuple[str, ...] = ()  # a gauge in [0, 1], used without the counters
    sleep_state: tuple[str, ...] = ()           # gauge labelled sleep_state=awake|weights_offloaded|discard_all
    prompt_length: tuple[str, ...] = ()         # histogram of prompt tokens per finished request
    generation_length: tuple[str, ...] = ()     # histogram of generated tokens per request
    kv_blocks_total: tuple[str, ...] = ()       # gauge of KV-cache blocks (or of token slots)
    kv_blocks_used: tuple[str, ...] = ()
    cache_config_info: tuple[str, ...] = ()     # info gauge whose num_gpu_blocks label is the total

    def merged(self, other: MetricNames) -> MetricNames:
        """Both name sets, this one's names first (for a body of unknown engine)."""
        def union(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(dict.fromkeys((*a, *b)))
        return MetricNames(**{f: union(getattr(self, f), getattr(other, f))
                              for f in self.__dataclass_fields__})


@dataclass(frozen=True)
class HealthSemantics:
    """What the engine's health endpoints say.

    A refused connection always means "still loading". 200 on `paths[0]` means ready.
    A status in `loading_statuses` means "still loading" until the first ready answer
    (an engine that binds its port before it can serve), and unhealthy after; any
    other status means unhealthy.
    """

    paths: tuple[str, ...]  # the first decides readiness
    loading_statuses: frozenset[int] = frozenset()
    note: str = ""


class OptionParser(StrEnum):
    """How the engine's command line reads options: the emulator accepts and refuses
    (exit status 2, a message naming the flag) as the real parser does."""

    ARGPARSE = "argparse"    # only the declared spellings; the error lists every unknown one
    # vLLM's FlexibleArgumentParser: also `--flag_name` for `--flag-name`, `--no-flag` for a
    # boolean `--flag` and `--flag.key` for a JSON option.
    FLEXIBLE_ARGPARSE = "flexible-argparse"
    CLICK = "click"          # only the declared spellings; the error names the first unknown one


@dataclass(frozen=True)
class LaunchFacts:
    """How the agent launches the engine; the command line itself is the runtime's."""

    runtime_module: str          # registers the `EngineRuntime` named like the entry
    deployment_tag: str          # short name in generated deployment ids
    drain_timeout_flag: str = ""  # flag that lets in-flight requests finish on SIGTERM ("" none)
    option_parser: OptionParser = OptionParser.ARGPARSE


@dataclass(frozen=True)
class BuildStep:
    """An ahead-of-time engine build some backends need before serving."""

    backends: frozenset[str]     # the backends that need it
    executable: tuple[str, ...]  # default build command (the agent's config may replace it)
    # Arguments after the executable; {source}, {output_dir} and {tensor_parallel_size}
    # are filled from the deployment spec and the agent's work directory.
    args: tuple[str, ...] = ()

    def argv(self, executable: tuple[str, ...] | list[str], *, source: str, output_dir: str,
             tensor_parallel_size: int) -> list[str]:
        values = {"source": source, "output_dir": output_dir,
                  "tensor_parallel_size": str(tensor_parallel_size)}
        return [*(executable or self.executable), *(a.format(**values) for a in self.args)]


@dataclass(frozen=True)
class ImageFacts:
    """How the engine's own container image runs it (docs/containers.md)."""

    repository: str                  # the official image, without a tag
    # True: the container's ENTRYPOINT is set to the engine's executable, because the
    # image's own changed between releases (vLLM: `python3 -m
    # vllm.entrypoints.openai.api_server`, later `vllm serve`). False: the image's
    # ENTRYPOINT is kept (NVIDIA's /opt/nvidia/nvidia_entrypoint.sh, which runs its
    # arguments) and the whole command line is the container's command.
    override_entrypoint: bool = False
    # ulimits the engine's docs ask for, by name: value (-1 = unlimited).
    ulimits: tuple[tuple[str, int], ...] = ()
    # The engine's own container home; the model cache mounts at <home>/.cache/huggingface.
    home: str = "/root"
    # An environment variable of the image that holds the engine's version, if any.
    version_env: str = ""
    # The release the emulated image of `make image-engines` emulates
    # (scripts/build-engine-images.sh; "" = none is built).
    emulated_release: str = ""

    def entrypoint_and_command(self, argv: tuple[str, ...] | list[str]
                               ) -> tuple[list[str] | None, list[str]]:
        """(ENTRYPOINT or None to keep the image's, command) for the command line `argv`."""
        if self.override_entrypoint:
            return [argv[0]], list(argv[1:])
        return None, list(argv)


@dataclass(frozen=True)
class CapacityPrior:
    """Capacity per replica relative to the baseline engine when nothing is measured:
    the middle of a public range, and the range."""

    ratio: float
    low: float
    high: float
    note: str = ""


@dataclass(frozen=True)
class LaunchFlags:
    """The spellings a release knows for the flags the agent's launch plan uses
    ("" = the release has no such flag)."""

    config_file: str = ""        # trtllm-serve: the YAML of extra LLM API options
    drain_timeout: str = ""      # lets in-flight requests finish on SIGTERM


@dataclass(frozen=True)
class ReleaseRow:
    """One row of an engine's version table, as the catalog writes it: the facts that
    change between releases, from the first release they apply to (`since`). The entry's
    health semantics, metric endpoints and backends hold on every row
    (`gearshift.common.engine_versions` resolves a version to its row)."""

    since: str
    metric_names: MetricNames
    sources: tuple[str, ...]                # where the row's facts were read
    flags: LaunchFlags = LaunchFlags()
    # The `metric_names` figures these releases export in Prometheus text (() = all of
    # them); the others come from another endpoint (trtllm-serve's JSON iteration stats).
    prometheus_figures: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class ReleaseRows:
    """An engine's version table: rows oldest first; a row holds up to the next row's
    `since`, the last one up to `until` (exclusive). The facts of each row were read in the
    release's own source; `common/engine_releases/<engine>-<version>.json` holds what
    `scripts/extract_engine_release.py` extracted from one release."""

    rows: tuple[ReleaseRow, ...]
    until: str


@dataclass(frozen=True)
class EngineEntry:
    """One serving engine."""

    name: str                        # the name in specs, policies, traces and metrics
    display_name: str                # for people
    executable: tuple[str, ...]      # default command that serves
    version_probe: tuple[str, ...]   # a command that prints the version (agent hook)
    package: str                     # the installed distribution whose METADATA has the version
    launch: LaunchFacts
    health: HealthSemantics
    metric_endpoints: tuple[MetricEndpoint, ...]
    metric_names: MetricNames
    prior: CapacityPrior
    emulator_module: str             # the `gearshift emulate --flavor NAME` flavour
    versions: ReleaseRows            # what each release accepts and exports
    backends: tuple[str, ...] = ()   # the first is the default; () = no backend choice
    build: BuildStep | None = None
    image: ImageFacts | None = None  # the engine's official container image
    gpu_vendor: str = ""             # GPUs it needs ("" = any the engine supports)
    sources: tuple[str, ...] = field(default_factory=tuple)  # where the facts were checked

    @property
    def default_backend(self) -> str:
        return self.backends[0] if self.backends else ""

    def backend_for(self, configured: str) -> str:
        """`configured` when this engine has that backend, else its default ("" if none)."""
        return configured if configured in self.backends else self.default_backend

    def needs_build(self, backend: str) -> bool:
        return self.build is not None and backend in self.build.backends

    @property
    def drains_gracefully(self) -> bool:
        return bool(self.launch.drain_timeout_flag)
