"""The SGLang flavour of the emulator: `sglang.launch_server` arguments, SGLang's HTTP
surface and its `sglang:` Prometheus metrics.

Checked against sgl-project/sglang (0.5 line): flags from `ServerArgs`
(`python/sglang/srt/server_args.py`, commit 001067ff; `--model-path`/`--model`,
`--host` default 127.0.0.1, `--port` default 30000, `--tp-size`/`--tensor-parallel-size`,
`--mem-fraction-static`, `--served-model-name`, the switch `--enable-metrics`); paths
from `python/sglang/srt/entrypoints/http_server.py` (commit 0025436e: `/health` and
`/health_generate`, `/get_model_info` with `model_path`, `tokenizer_path`,
`is_generation`, `preferred_sampling_params`, `weight_version`); metric names and
default buckets from `TokenizerMetricsCollector` and `SchedulerMetricsCollector` in
`python/sglang/srt/metrics/collector.py` (commit 00ae9c15; with the queue-time
histogram, the cached-tokens and retracted-requests counters), labelled `model_name` as in
the capture of `docs/references/production_metrics.md`. `/metrics` exists only with
`--enable-metrics` (404 without, as SGLang mounts it only then). On SIGTERM the server
stops taking requests and lets running ones finish for a fixed grace.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gearshift.agents.emulator.app import STATE_KEY, prometheus_metrics
from gearshift.agents.emulator.args import (
    DEFAULT_GPU_MEMORY_FRACTION,
    EngineArgs,
    EngineArgsError,
    fraction_option,
    int_option,
    scan_flags,
)
from gearshift.agents.emulator.batching import KV_TOKENS_PER_SLOT, BatchEngine
from gearshift.agents.emulator.config import EmulatorOptions
from gearshift.agents.emulator.flavors import register
from gearshift.agents.emulator.iterstats import IterationStats
from gearshift.agents.emulator.metrics import EngineMetrics, RequestRecord, emulator_info

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000
DRAIN_GRACE_S = 30.0
# TokenizerMetricsCollector's default buckets (collector.py).
TTFT_BUCKETS_S = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS_S = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
                 0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000,
                 8.000)
E2E_BUCKETS_S = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400,
                 600, 1200, 1800, 2400)

# SchedulerMetricsCollector's queue_time buckets (collector.py).
QUEUE_BUCKETS_S = (0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100,
                   200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000,
                   2500, 3000)

_FLAGS: dict[str, tuple[str, ...]] = {
    "model": ("--model-path", "--model"),
    "host": ("--host",),
    "port": ("--port",),
    "served_model_name": ("--served-model-name",),
    "tensor_parallel_size": ("--tp-size", "--tensor-parallel-size"),
    "gpu_memory_fraction": ("--mem-fraction-static",),
}
_SWITCHES: dict[str, tuple[str, ...]] = {"enable_metrics": ("--enable-metrics",)}


def parse_sglang(argv: list[str]) -> EngineArgs:
    """`--model-path M --host H --port P --served-model-name N --tp-size T
    --mem-fraction-static F [--enable-metrics]` (what follows `python -m sglang.launch_server`)."""
    positionals, known, ignored = scan_flags(argv, _FLAGS, _SWITCHES)
    if positionals:
        raise EngineArgsError(f"sglang.launch_server: unexpected positional arguments "
                              f"{positionals}; the model goes in --model-path")
    model = known.get("model", "")
    if not model:
        raise EngineArgsError("sglang.launch_server: missing --model-path")
    return EngineArgs(
        flavor="sglang",
        command="serve",
        model=model,
        served_model_name=known.get("served_model_name") or model,
        host=known.get("host") or DEFAULT_HOST,
        port=int_option("--port", known.get("port", str(DEFAULT_PORT)), 0, 65535),
        tensor_parallel_size=int_option("--tp-size", known.get("tensor_parallel_size", "1"),
                                        1, 1024),
        gpu_memory_fraction=fraction_option(
            "--mem-fraction-static",
            known.get("gpu_memory_fraction", str(DEFAULT_GPU_MEMORY_FRACTION))),
        enable_metrics=known.get("enable_metrics") == "true",
        ignored=tuple(ignored),
    )


class SglangMetrics:
    """`sglang:*` metrics as SGLang exposes them on `/metrics` with `--enable-metrics`."""

    def __init__(self, engine: BatchEngine, *, model_name: str, engine_version: str = "",
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        emulator_info(reg, flavor="sglang", engine_version=engine_version)
        names = ("model_name",)
        lbl = {"model_name": model_name}
        max_tokens = engine.max_batch * KV_TOKENS_PER_SLOT

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=reg, multiprocess_mode="mostrecent")

        gauge("sglang:num_running_reqs", "The number of running requests.").labels(
            **lbl).set_function(lambda: engine.running)
        gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.").labels(
            **lbl).set_function(lambda: engine.waiting)
        gauge("sglang:token_usage", "The token usage.").labels(**lbl).set_function(
            lambda: engine.kv_usage)
        gauge("sglang:num_used_tokens", "The number of used tokens.").labels(
            **lbl).set_function(lambda: engine.kv_tokens)
        gauge("sglang:max_total_num_tokens",
              "Maximum total number of tokens in the KV cache pool.").labels(**lbl).set(max_tokens)
        gauge("sglang:gen_throughput", "The generation throughput (token/s).").labels(**lbl)
        cache = engine.prefix_cache
        gauge("sglang:cache_hit_rate", "The prefix cache hit rate.").labels(**lbl).set_function(
            lambda: cache.hit_tokens / cache.queried_tokens if cache.queried_tokens else 0.0)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=reg)

        self.prompt_tokens = counter("sglang:prompt_tokens",
                                     "Number of prefill tokens processed.").labels(**lbl)
        self.generation_tokens = counter("sglang:generation_tokens",
                                         "Number of generation tokens processed.").labels(**lbl)
        self.requests = counter("sglang:num_requests", "Number of requests processed.").labels(
            **lbl)
        self.aborted = counter("sglang:num_aborted_requests", "Number of requests aborted."
                               ).labels(**lbl)
        self.cached_tokens = counter("sglang:cached_tokens", "Number of cached prompt tokens."
                                     ).labels(**lbl)
        # The emulated scheduler never retracts a request (each holds its KV budget).
        counter("sglang:num_retracted_requests", "Total number of retracted requests.").labels(
            **lbl)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=reg)

        self.ttft = hist("sglang:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", TTFT_BUCKETS_S
                         ).labels(**lbl)
        self.itl = hist("sglang:inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.", ITL_BUCKETS_S
                        ).labels(**lbl)
        self.queue = hist("sglang:queue_time_seconds", "Histogram of queueing time in seconds.",
                          QUEUE_BUCKETS_S).labels(**lbl)
        self.e2e = hist("sglang:e2e_request_latency_seconds",
                        "Histogram of End-to-end request latency in seconds", E2E_BUCKETS_S
                        ).labels(**lbl)

    def observe_token(self, itl_s: float) -> None:
        self.itl.observe(itl_s)

    def observe_request(self, record: RequestRecord) -> None:
        self.prompt_tokens.inc(record.prompt_tokens)
        self.generation_tokens.inc(record.generation_tokens)
        self.cached_tokens.inc(record.cached_tokens)
        if record.finished_reason == "abort":
            self.aborted.inc()
            return
        self.requests.inc()
        self.queue.observe(record.queue_s)
        self.e2e.observe(record.e2e_s)
        if record.ttft_s is not None:
            self.ttft.observe(record.ttft_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def metrics(request: web.Request) -> web.StreamResponse:
    if not request.app[STATE_KEY].args.enable_metrics:
        raise web.HTTPNotFound(text='{"detail":"Not Found"}', content_type="application/json")
    return await prometheus_metrics(request)


async def model_info(request: web.Request) -> web.Response:
    args = request.app[STATE_KEY].args
    return web.json_response({"model_path": args.model, "tokenizer_path": args.model,
                              "is_generation": True, "preferred_sampling_params": None,
                              "weight_version": "default"})


class SglangFlavor:
    name = "sglang"
    owned_by = "sglang"
    default_capacity_rps = 40.0
    default_version = "0.5.23"  # the newest release of the version table

    def parse(self, argv: list[str]) -> EngineArgs:
        return parse_sglang(argv)

    def make_metrics(self, engine: BatchEngine, args: EngineArgs, options: EmulatorOptions
                     ) -> tuple[EngineMetrics, IterationStats | None]:
        return SglangMetrics(engine, model_name=args.served_model_name,
                             engine_version=options.engine_version), None

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/metrics", metrics), web.get("/get_model_info", model_info)]

    def drain_grace_s(self, args: EngineArgs) -> float:
        return DRAIN_GRACE_S


SGLANG = register(SglangFlavor())
