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

The entry's types (`EngineEntry` and its parts) are in `common/engine_facts.py`; this
module holds the entries and the lookups, and re-exports the types for its users.
Agent-side code is named by module path (`runtime_module`, `emulator_module`)
and imported by the agent when needed, so this package imports no other
gearshift package.
"""

from __future__ import annotations

from dataclasses import replace

from gearshift.common.engine_facts import (
    BuildStep,
    CapacityPrior,
    EngineEntry,
    HealthSemantics,
    ImageFacts,
    LaunchFacts,
    LaunchFlags,
    MetricEndpoint,
    MetricFormat,
    MetricNames,
    OptionParser,
    ReleaseRow,
    ReleaseRows,
)
from gearshift.common.errors import InvalidArgument

__all__ = [  # the catalog and its lookups; the entry's types re-exported from engine_facts
    "BASELINE_ENGINE", "CATALOG", "ENGINE_NAMES", "SGLANG", "TENSORRT_LLM", "VLLM",
    "BuildStep", "CapacityPrior", "EngineEntry", "HealthSemantics", "ImageFacts",
    "LaunchFacts", "LaunchFlags", "MetricEndpoint", "MetricFormat", "MetricNames",
    "OptionParser", "ReleaseRow", "ReleaseRows",
    "any_engine_metric_names", "display_names", "engine_entry", "is_engine",
]

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
