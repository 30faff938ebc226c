"""The engine catalog: everything gearshift knows about each serving engine, in one place.

Every engine-specific branch in gearshift reads an `EngineEntry` from here instead
of testing an engine name: the agent's config and Hello, the runtimes (launch plan,
health), the metric scrapers (endpoints, metric names), the version tables (what
each release accepts and exports), the emulator (its option parser, the release its
image emulates), the controller's validation, placement and migration steps, the
policy schema and signal vocabulary, the capacity priors and the backtest baselines.
Adding an engine means adding one entry here, one runtime module, one emulator
flavour and its releases' facts from `scripts/extract_engine_release.py` (see
"Adding an engine" in docs/engines.md).

Agent-side code is named by module path (`runtime_module`, `emulator_module`)
and imported by the agent when needed, so this package imports no other
gearshift package.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum

from gearshift.common.errors import InvalidArgument


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
    # engine's unit (vLLM, SGLang: tokens; TensorRT-LLM: blocks); their ratio is the hit rate.
    prefix_cache_hits: tuple[str, ...] = ()
    prefix_cache_queries: tuple[str, ...] = ()
    prefix_cache_misses: tuple[str, ...] = ()
    prefix_cache_hit_rate: tuple[str, ...] = ()  # a gauge in [0, 1], used without the counters
    sleep_state: tuple[str, ...] = ()           # gauge labelled sleep_state=awake|weights_offloaded|discard_all
    prompt_length: tuple[str, ...] = ()         # histogram of prompt tokens per finished request
    generation_length: tuple[str, ...] = ()     # histogram of generated tokens per request
    kv_blocks_total: tuple[str, ...] = ()       # gauge of KV-cache blocks (SGLang: token slots)
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


# -- vLLM ---------------------------------------------------------------------------------
_VLLM_NAMES = MetricNames(
    prefixes=("vllm:",),
    kv_cache_usage=("kv_cache_usage_perc", "gpu_cache_usage_perc"),  # before 0.10: gpu_
    itl=("inter_token_latency_seconds", "time_per_output_token_seconds"),
    queue_time=("request_queue_time_seconds",),
    preemptions=("num_preemptions",),
    prefix_cache_hits=("prefix_cache_hits",),
    prefix_cache_queries=("prefix_cache_queries",),
    sleep_state=("engine_sleep_state",),
    prompt_length=("request_prompt_tokens",),
    generation_length=("request_generation_tokens",),
    cache_config_info=("cache_config_info",))
_VLLM_SRC = ("PyPI wheel vllm=={v}: vllm/engine/arg_utils.py, vllm/entrypoints/**/cli_args.py "
             "(FrontendArgs), vllm/v1/metrics/*.py; extracted in "
             "common/engine_releases/vllm-{v}.json")


def _vllm(since: str, *, names: MetricNames, drain: str = "", note: str = "") -> ReleaseRow:
    return ReleaseRow(since=since, metric_names=names, flags=LaunchFlags(drain_timeout=drain),
                      sources=(_VLLM_SRC.format(v=since),), note=note)


# Before 0.12 there is no vllm:engine_sleep_state (a sleeping engine looks idle).
_VLLM_TPOT_ONLY = replace(_VLLM_NAMES, itl=("time_per_output_token_seconds",),
                          kv_cache_usage=("kv_cache_usage_perc", "gpu_cache_usage_perc"),
                          sleep_state=())
_VLLM_ITL = replace(_VLLM_NAMES, itl=("inter_token_latency_seconds",
                                      "time_per_output_token_seconds"),
                    kv_cache_usage=("kv_cache_usage_perc", "gpu_cache_usage_perc"),
                    sleep_state=())
_VLLM_ITL_ONLY = replace(_VLLM_NAMES, itl=("inter_token_latency_seconds",),
                         kv_cache_usage=("kv_cache_usage_perc",))

VLLM = EngineEntry(
    name="vllm",
    display_name="vLLM",
    executable=("vllm",),
    version_probe=("vllm", "--version"),
    package="vllm",
    launch=LaunchFacts(runtime_module="gearshift.agents.runtimes.vllm", deployment_tag="vllm",
                       drain_timeout_flag="--shutdown-timeout",
                       option_parser=OptionParser.FLEXIBLE_ARGPARSE),
    health=HealthSemantics(paths=("/health",),
                           note="connections refused while loading; 200 ready; 503 dead"),
    metric_endpoints=(MetricEndpoint("/metrics", MetricFormat.PROMETHEUS),),
    metric_names=_VLLM_NAMES,
    prior=CapacityPrior(1.0, 1.0, 1.0, "the baseline engine"),
    emulator_module="gearshift.agents.emulator.flavor_vllm",
    versions=ReleaseRows(
        rows=(
            _vllm("0.10.0", names=_VLLM_TPOT_ONLY,
                  note="ITL only as vllm:time_per_output_token_seconds; no --shutdown-timeout"),
            _vllm("0.10.2", names=_VLLM_ITL,
                  note="vllm:inter_token_latency_seconds next to the deprecated TPOT name"),
            _vllm("0.12.0", names=replace(_VLLM_ITL, kv_cache_usage=("kv_cache_usage_perc",),
                                          sleep_state=_VLLM_NAMES.sleep_state),
                  note="vllm:gpu_cache_usage_perc gone; vllm:engine_sleep_state added"),
            _vllm("0.15.0", names=_VLLM_ITL_ONLY,
                  note="vllm:time_per_output_token_seconds gone"),
            _vllm("0.18.0", names=_VLLM_ITL_ONLY, drain="--shutdown-timeout",
                  note="--shutdown-timeout added"),
        ),
        until="0.34"),
    image=ImageFacts(repository="docker.io/vllm/vllm-openai", override_entrypoint=True,
                     emulated_release="0.11.0"),
    sources=("vLLM 0.11 `vllm serve` CLI and `vllm/v1/metrics/loggers.py`; "
             "tests/fixtures/engine-metrics/vllm-0.11-metrics.txt",),
)

# -- TensorRT-LLM -------------------------------------------------------------------------
_TRT_NAMES = MetricNames(
    prefixes=("trtllm_", ""),  # 1.2.x wrote the names without a prefix
    kv_cache_usage=("kv_cache_usage_perc", "kv_cache_utilization"),
    itl=("inter_token_latency_seconds", "time_per_output_token_seconds"),
    queue_time=("request_queue_time_seconds",),
    prefix_cache_hits=("kv_cache_reused_blocks",),
    prefix_cache_misses=("kv_cache_missed_blocks",),
    prefix_cache_hit_rate=("kv_cache_hit_rate",),
    kv_blocks_total=("kv_cache_max_blocks",),
    kv_blocks_used=("kv_cache_used_blocks",))
_TRT_PREFIXED = replace(_TRT_NAMES, prefixes=("trtllm_",),
                        kv_cache_usage=("kv_cache_utilization",),
                        itl=("time_per_output_token_seconds",))
_TRT_UNPREFIXED = replace(_TRT_PREFIXED, prefixes=("",))
# Seen without prefix in real captures; the rest comes from the JSON iteration stats.
_TRT_UNPREFIXED_FIGURES = ("ttft", "itl", "e2e")
_TRT_ALIAS_SRC = ("NVIDIA/TensorRT-LLM PR #9104 (opened 2025-11-12, after the 1.1 release "
                  "branch): adds `--config` as an alias of `--extra_llm_api_options` to "
                  "trtllm-serve, trtllm-bench and trtllm-eval")

TENSORRT_LLM = EngineEntry(
    name="tensorrt-llm",
    display_name="TensorRT-LLM",
    executable=("trtllm-serve",),
    # Reads the package metadata: importing tensorrt_llm would load CUDA libraries.
    version_probe=("python3", "-c",
                   "import importlib.metadata as m; print(m.version('tensorrt_llm'))"),
    package="tensorrt_llm",
    launch=LaunchFacts(runtime_module="gearshift.agents.runtimes.trtllm", deployment_tag="trtllm",
                       option_parser=OptionParser.CLICK),
    health=HealthSemantics(paths=("/health", "/health_generate"),
                           note="connections refused while loading; 200 ready"),
    metric_endpoints=(
        # Prometheus text only with `return_perf_metrics: true`; 404 otherwise.
        MetricEndpoint("/prometheus/metrics", MetricFormat.PROMETHEUS, optional=True),
        MetricEndpoint("/metrics", MetricFormat.TRTLLM_ITERATIONS),
    ),
    metric_names=_TRT_NAMES,
    prior=CapacityPrior(1.05, 0.94, 1.16,
                        "vLLM a few % ahead on 8B models .. TensorRT-LLM +16% on 70B"),
    emulator_module="gearshift.agents.emulator.flavor_trtllm",
    versions=ReleaseRows(
        rows=(
            ReleaseRow(
                "1.0.0", _TRT_UNPREFIXED, flags=LaunchFlags(config_file="--extra_llm_api_options"),
                prometheus_figures=_TRT_UNPREFIXED_FIGURES,
                sources=("docs nvidia.github.io/TensorRT-LLM/1.1.0rc2.post1 (serving_with_trtllm_"
                         "serve: `--extra_llm_api_options`)", _TRT_ALIAS_SRC,
                         "PR #5785 (/prometheus/metrics, names without prefix); "
                         "common/engine_releases/tensorrt-llm-1.0.0.json"),
                note="no `--config` alias; Prometheus names without prefix"),
            ReleaseRow(
                "1.2.0", _TRT_UNPREFIXED, flags=LaunchFlags(config_file="--config"),
                prometheus_figures=_TRT_UNPREFIXED_FIGURES,
                sources=(_TRT_ALIAS_SRC, "vllm-project/aibrix issue #2004 (2026-03 capture of "
                         "/prometheus/metrics without prefix); "
                         "common/engine_releases/tensorrt-llm-1.2.0.json"),
                note="`--config` alias of `--extra_llm_api_options`"),
            ReleaseRow(
                "1.3.0", _TRT_PREFIXED, flags=LaunchFlags(config_file="--config"),
                sources=("tensorrt_llm/commands/serve.py @ 00209af1 and "
                         "tensorrt_llm/metrics/collector.py @ 050f80de (main line): "
                         "metric_prefix = \"trtllm_\"; "
                         "common/engine_releases/tensorrt-llm-1.3.0.json",),
                note="Prometheus names with the `trtllm_` prefix"),
        ),
        until="1.5"),
    # docker/release.md: --ipc=host --ulimit memlock=-1 --ulimit stack=67108864; the
    # release stage sets TRT_LLM_VERSION (docker/Dockerfile.multi).
    image=ImageFacts(repository="nvcr.io/nvidia/tensorrt-llm/release",
                     ulimits=(("memlock", -1), ("stack", 67108864)),
                     version_env="TRT_LLM_VERSION", emulated_release="1.2.0"),
    backends=("pytorch", "tensorrt"),
    build=BuildStep(backends=frozenset({"tensorrt"}), executable=("trtllm-build",),
                    args=("--checkpoint_dir", "{source}", "--output_dir", "{output_dir}",
                          "--tp_size", "{tensor_parallel_size}")),
    gpu_vendor="NVIDIA",
    sources=("TensorRT-LLM `trtllm-serve` docs (docs/source/commands/trtllm-serve); "
             "tensorrt_llm/metrics/collector.py; tests/fixtures/engine-metrics/SOURCES.md",),
)

# -- SGLang -------------------------------------------------------------------------------
_SGL_NAMES = MetricNames(
    prefixes=("sglang:",),
    finished=("num_requests",),
    errors=("num_aborted_requests",),
    running=("num_running_reqs",),
    waiting=("num_queue_reqs",),
    kv_cache_usage=("token_usage",),  # used / total tokens of the KV-cache pool
    itl=("inter_token_latency_seconds", "time_per_output_token_seconds"),
    queue_time=("queue_time_seconds",),
    preemptions=("num_retracted_requests",),
    prefix_cache_hits=("cached_tokens",),
    prefix_cache_queries=("prompt_tokens",),
    prefix_cache_hit_rate=("cache_hit_rate",),
    prompt_length=("prompt_tokens_histogram",),
    generation_length=("generation_tokens_histogram",),
    kv_blocks_total=("max_total_num_tokens",),
    kv_blocks_used=("num_used_tokens",))
_SGL_SRC = ("PyPI wheel sglang=={v}: sglang/srt/server_args.py, sglang/srt/arg_groups/fields/, "
            "sglang/srt/metrics/ or srt/observability/; extracted in "
            "common/engine_releases/sglang-{v}.json")


def _sgl(since: str, *, names: MetricNames = _SGL_NAMES, read: str = "",
         note: str = "") -> ReleaseRow:
    return ReleaseRow(since=since, metric_names=names, sources=(_SGL_SRC.format(v=read or since),),
                      note=note)


SGLANG = EngineEntry(
    name="sglang",
    display_name="SGLang",
    executable=("python3", "-m", "sglang.launch_server"),
    version_probe=("python3", "-c", "import importlib.metadata as m; print(m.version('sglang'))"),
    package="sglang",
    launch=LaunchFacts(runtime_module="gearshift.agents.runtimes.sglang", deployment_tag="sglang"),
    # The HTTP server binds before the model is warm: 503 until a one-token generation
    # succeeds (and again while it exits).
    health=HealthSemantics(paths=("/health", "/health_generate"),
                           loading_statuses=frozenset({503}),
                           note="503 while starting, 200 once a 1-token generation succeeds"),
    # Only with --enable-metrics, which the runtime always passes.
    metric_endpoints=(MetricEndpoint("/metrics", MetricFormat.PROMETHEUS),),
    metric_names=_SGL_NAMES,
    prior=CapacityPrior(1.0, 0.94, 1.22,
                        "published serving benchmarks put SGLang and vLLM within a few % on "
                        "dense models, SGLang ahead with shared prefixes: no default lead"),
    emulator_module="gearshift.agents.emulator.flavor_sglang",
    versions=ReleaseRows(
        rows=(
            _sgl("0.4.10", names=replace(_SGL_NAMES, queue_time=(), preemptions=(),
                                         kv_blocks_total=()),
                 note="no sglang:queue_time_seconds, num_retracted_requests, "
                      "max_total_num_tokens"),
            _sgl("0.5.0", names=replace(_SGL_NAMES, preemptions=(), kv_blocks_total=()),
                 read="0.5.5",  # the first 0.5 wheel read (0.5.0 could not be fetched)
                 note="sglang:queue_time_seconds added (read in 0.5.5; 0.5.0-0.5.4 not read)"),
            _sgl("0.5.6", names=replace(_SGL_NAMES, preemptions=()),
                 note="sglang:max_total_num_tokens added"),
            _sgl("0.5.7", note="sglang:num_retracted_requests added"),
        ),
        until="0.6"),
    image=ImageFacts(repository="docker.io/lmsysorg/sglang", emulated_release="0.5.7"),
    sources=("sgl-project/sglang 0.5 line: python/sglang/srt/server_args.py (001067ff), "
             "python/sglang/srt/entrypoints/http_server.py (0025436e), "
             "python/sglang/srt/metrics/collector.py (00ae9c15); "
             "docs/references/production_metrics.md (00b08c49); "
             "tests/fixtures/engine-metrics/SOURCES.md",),
)

CATALOG: tuple[EngineEntry, ...] = (VLLM, TENSORRT_LLM, SGLANG)
ENGINE_NAMES: tuple[str, ...] = tuple(e.name for e in CATALOG)
BASELINE_ENGINE = VLLM.name  # capacity ratios (priors, `capacity_gain.*`) are relative to it
_BY_NAME = {e.name: e for e in CATALOG}


def is_engine(name: str) -> bool:
    return name in _BY_NAME


def engine_entry(name: str, what: str = "engine") -> EngineEntry:
    """The entry named `name`; `InvalidArgument` listing the known names otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise InvalidArgument(
            f"{what}: unknown engine {name!r}; known: {', '.join(ENGINE_NAMES)}") from None


def display_names(conjunction: str = "and") -> str:
    """Every entry's display name in catalog order, for prose: "vLLM, TensorRT-LLM and SGLang"."""
    names = [e.display_name for e in CATALOG]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {conjunction} {names[-1]}"


def any_engine_metric_names() -> MetricNames:
    """Every entry's metric names merged, in catalog order: for a body of unknown origin."""
    names = CATALOG[0].metric_names
    for entry in CATALOG[1:]:
        names = names.merged(entry.metric_names)
    return names
