"""The emulated engines' Prometheus metrics, in each engine's real names and buckets.

vLLM: `vllm:` names with labels `model_name` and `engine="0"` and the bucket
bounds of the captured 0.11 scrape (`fixtures/engine-metrics/vllm-0.11-metrics.txt`),
including the deprecated `vllm:time_per_output_token_seconds` next to
`vllm:inter_token_latency_seconds`. trtllm-serve: `trtllm_` names (or the 1.2.x
unprefixed ones) with labels `model_name` and `engine_type`, as served on
`/prometheus/metrics`. Each container owns its CollectorRegistry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from gearshift.agents.emulator.batching import KV_TOKENS_PER_BLOCK, BatchEngine

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                           1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                             40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
# trtllm-serve's prefill-time buckets (tensorrt_llm/metrics/collector.py).
TRTLLM_PREFILL_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                            10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
FINISHED_REASONS = ("stop", "length", "abort")


def _is_level(engine: BatchEngine, level: int) -> Callable[[], float]:
    return lambda: float(engine.sleep_level == level)


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def emulator_info(registry: CollectorRegistry, *, flavor: str, engine_version: str) -> None:
    """`gearshift_emulator_info`: marks an emulated engine and carries its version.

    The real engines have no version metric; the gearshift_ name keeps this
    apart from theirs (scrapers ignore unknown families).
    """
    Gauge("gearshift_emulator_info", "Emulated engine: flavor and engine version.",
          ("flavor", "engine_version"), registry=registry).labels(
        flavor=flavor, engine_version=engine_version).set(1.0)


@dataclass
class RequestRecord:
    """Timings of one finished (or aborted) request, in seconds."""

    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    generation_tokens: int = 0
    max_tokens: int = 0
    queue_s: float = 0.0
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    finished_reason: str = "stop"

    @property
    def decode_s(self) -> float:
        return sum(self.itls_s)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        return self.decode_s / len(self.itls_s) if self.itls_s else None


class EngineMetrics(Protocol):
    """What the HTTP app needs from a metrics container."""

    def observe_token(self, itl_s: float) -> None: ...
    def observe_request(self, record: RequestRecord) -> None: ...
    def render(self) -> bytes: ...


class VllmMetrics:
    """`vllm:*` metrics as vLLM 0.11 (V1 engine) exposes them on `/metrics`."""

    def __init__(self, engine: BatchEngine, *, model_name: str, gpu_memory_fraction: float,
                 engine_version: str = "", registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        emulator_info(reg, flavor="vllm", engine_version=engine_version)
        names = ("model_name", "engine")
        lbl = {"model_name": model_name, "engine": "0"}
        self._lbl = lbl
        Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
              names, registry=reg).labels(**lbl).set_function(lambda: engine.running)
        Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
              names, registry=reg).labels(**lbl).set_function(lambda: engine.waiting)
        Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
              names, registry=reg).labels(**lbl).set_function(lambda: engine.kv_usage)
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            names, registry=reg).labels(**lbl)
        self.prefix_hits = Counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.",
                                   names, registry=reg).labels(**lbl)
        sleep = Gauge("vllm:engine_sleep_state",
                      "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means "
                      "engine is awake; weights_offloaded = 1 means sleep level 1; "
                      "discard_all = 1 means sleep level 2.",
                      (*names, "sleep_state"), registry=reg)
        for state, level in (("awake", 0), ("weights_offloaded", 1), ("discard_all", 2)):
            sleep.labels(sleep_state=state, **lbl).set_function(_is_level(engine, level))
        self.preemptions = Counter("vllm:num_preemptions",
                                   "Cumulative number of preemption from the engine.",
                                   names, registry=reg).labels(**lbl)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     names, registry=reg).labels(**lbl)
        self.generation_tokens = Counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.",
                                         names, registry=reg).labels(**lbl)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          (*names, "finished_reason"), registry=reg)
        self.success = {reason: success.labels(finished_reason=reason, **lbl)
                        for reason in FINISHED_REASONS}

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=reg)

        self.req_prompt = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                               TOKEN_COUNT_BUCKETS).labels(**lbl)
        self.req_generation = hist("vllm:request_generation_tokens",
                                   "Number of generation tokens processed.",
                                   TOKEN_COUNT_BUCKETS).labels(**lbl)
        self.req_max_tokens = hist("vllm:request_params_max_tokens",
                                   "Histogram of the max_tokens request parameter.",
                                   TOKEN_COUNT_BUCKETS).labels(**lbl)
        self.ttft = hist("vllm:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS_S).labels(**lbl)
        self.tpot = hist("vllm:time_per_output_token_seconds",
                         "Histogram of time per output token in seconds."
                         "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
                         TOKEN_LATENCY_BUCKETS_S).labels(**lbl)
        self.itl = hist("vllm:inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.",
                        TOKEN_LATENCY_BUCKETS_S).labels(**lbl)
        self.req_tpot = hist("vllm:request_time_per_output_token_seconds",
                             "Histogram of time_per_output_token_seconds per request.",
                             TOKEN_LATENCY_BUCKETS_S).labels(**lbl)
        self.e2e = hist("vllm:e2e_request_latency_seconds",
                        "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS_S).labels(**lbl)
        self.queue = hist("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.",
                          REQUEST_LATENCY_BUCKETS_S).labels(**lbl)
        self.inference = hist("vllm:request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.",
                              REQUEST_LATENCY_BUCKETS_S).labels(**lbl)
        self.prefill = hist("vllm:request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.",
                            REQUEST_LATENCY_BUCKETS_S).labels(**lbl)
        self.decode = hist("vllm:request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.",
                           REQUEST_LATENCY_BUCKETS_S).labels(**lbl)
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
              ("block_size", "engine", "gpu_memory_utilization", "num_gpu_blocks"),
              registry=reg).labels(block_size=str(KV_TOKENS_PER_BLOCK), engine="0",
                                   gpu_memory_utilization=str(gpu_memory_fraction),
                                   num_gpu_blocks=str(engine.kv_max_blocks)).set(1.0)

    def observe_token(self, itl_s: float) -> None:
        self.itl.observe(itl_s)
        self.tpot.observe(itl_s)

    def observe_request(self, record: RequestRecord) -> None:
        self.prompt_tokens.inc(record.prompt_tokens)
        self.generation_tokens.inc(record.generation_tokens)
        self.prefix_queries.inc(record.prompt_tokens)
        self.prefix_hits.inc(record.cached_tokens)
        self.success[record.finished_reason].inc()
        self.req_prompt.observe(record.prompt_tokens)
        self.req_generation.observe(record.generation_tokens)
        self.req_max_tokens.observe(record.max_tokens)
        self.queue.observe(record.queue_s)
        self.e2e.observe(record.e2e_s)
        if record.ttft_s is not None:
            self.ttft.observe(record.ttft_s)
            self.prefill.observe(max(0.0, record.ttft_s - record.queue_s))
            self.inference.observe(max(0.0, record.e2e_s - record.queue_s))
            self.decode.observe(record.decode_s)
        if record.tpot_s is not None:
            self.req_tpot.observe(record.tpot_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TrtllmMetrics:
    """trtllm-serve's `/prometheus/metrics` (needs `return_perf_metrics: true`)."""

    def __init__(self, *, model_name: str, engine_type: str, prefixed: bool = True,
                 engine_version: str = "", engine: BatchEngine | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        emulator_info(reg, flavor="tensorrt-llm", engine_version=engine_version)
        prefix = "trtllm_" if prefixed else ""
        names = ("model_name", "engine_type")
        lbl = {"model_name": model_name, "engine_type": engine_type}
        success = Counter(f"{prefix}request_success", "Count of successfully processed requests.",
                          (*names, "finished_reason"), registry=reg)
        self.success = {reason: success.labels(finished_reason=reason, **lbl)
                        for reason in FINISHED_REASONS}
        self.e2e = Histogram(f"{prefix}e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds.", names,
                             buckets=REQUEST_LATENCY_BUCKETS_S, registry=reg).labels(**lbl)
        self.ttft = Histogram(f"{prefix}time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", names,
                              buckets=TTFT_BUCKETS_S, registry=reg).labels(**lbl)
        self.tpot = Histogram(f"{prefix}time_per_output_token_seconds",
                              "Histogram of time per output token in seconds.", names,
                              buckets=TOKEN_LATENCY_BUCKETS_S, registry=reg).labels(**lbl)
        self.queue = Histogram(f"{prefix}request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", names,
                               buckets=REQUEST_LATENCY_BUCKETS_S, registry=reg).labels(**lbl)
        self.prefill = Histogram(f"{prefix}request_prefill_time_seconds",
                                 "Histogram of prefill (context) phase duration in seconds "
                                 "(first_token_time - first_scheduled_time).", names,
                                 buckets=TRTLLM_PREFILL_BUCKETS_S, registry=reg).labels(**lbl)
        self.decode = Histogram(f"{prefix}request_decode_time_seconds",
                                "Histogram of decode (generation) phase duration in seconds "
                                "(last_token_time - first_token_time).", names,
                                buckets=REQUEST_LATENCY_BUCKETS_S, registry=reg).labels(**lbl)
        # (reused-blocks counter, missed-blocks counter, tokens per block) when logged.
        self._reuse: tuple[Any, Any, int] | None = None
        if engine is not None:
            self._iteration_metrics(engine, prefix, names, lbl)

    def _iteration_metrics(self, engine: BatchEngine, prefix: str, names: tuple[str, ...],
                           lbl: dict[str, str]) -> None:
        """The iteration-level families (the real server logs them from its iteration
        stats, so only with `enable_iter_perf_stats`): KV blocks and block reuse."""
        reg, cache = self.registry, engine.prefix_cache

        def gauge(name: str, doc: str, value: Callable[[], float]) -> None:
            Gauge(prefix + name, doc, names, registry=reg).labels(**lbl).set_function(value)

        gauge("kv_cache_hit_rate", "KV cache hit rate", lambda: _ratio(
            cache.reused_blocks, cache.reused_blocks + cache.missed_blocks))
        gauge("kv_cache_utilization", "KV cache utilization",
              lambda: engine.kv_used_blocks / engine.kv_max_blocks)
        gauge("kv_cache_max_blocks", "Maximum number of KV cache blocks",
              lambda: engine.kv_max_blocks)
        gauge("kv_cache_free_blocks", "Number of free KV cache blocks",
              lambda: engine.kv_max_blocks - engine.kv_used_blocks)
        gauge("kv_cache_used_blocks", "Number of used KV cache blocks",
              lambda: engine.kv_used_blocks)
        reused = Counter(prefix + "kv_cache_reused_blocks",
                         "Cumulative number of KV cache blocks reused (cache hits)",
                         names, registry=reg).labels(**lbl)
        missed = Counter(prefix + "kv_cache_missed_blocks",
                         "Cumulative number of KV cache blocks missed (cache misses)",
                         names, registry=reg).labels(**lbl)
        self._reuse = (reused, missed, cache.block_tokens)

    def observe_token(self, itl_s: float) -> None:
        """trtllm-serve observes per-request TPOT only."""

    def observe_request(self, record: RequestRecord) -> None:
        if self._reuse is not None:
            reused, missed, block_tokens = self._reuse
            blocks = -(-record.prompt_tokens // block_tokens)
            reused.inc(record.cached_tokens // block_tokens)
            missed.inc(blocks - record.cached_tokens // block_tokens)
        self.success[record.finished_reason].inc()
        if record.finished_reason == "abort":
            return
        self.e2e.observe(record.e2e_s)
        self.queue.observe(record.queue_s)
        if record.ttft_s is not None:
            self.ttft.observe(record.ttft_s)
            self.prefill.observe(max(0.0, record.ttft_s - record.queue_s))
            self.decode.observe(record.decode_s)
        if record.tpot_s is not None:
            self.tpot.observe(record.tpot_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
