"""The trtllm-serve flavour of the emulator.

`trtllm-serve` arguments (and the `build` stand-in for `trtllm-build`); JSON
iteration stats on `/metrics` (drained on read, only with
`enable_iter_perf_stats`), Prometheus text on `/prometheus/metrics` (`trtllm_`
names, or the 1.2.x unprefixed ones; empty without `return_perf_metrics`). On
SIGTERM it lets in-flight requests finish for a fixed grace.
"""

from __future__ import annotations

from aiohttp import web

from gearshift.agents.emulator.app import PROMETHEUS_CONTENT_TYPE, STATE_KEY
from gearshift.agents.emulator.args import EngineArgs, parse_trtllm
from gearshift.agents.emulator.batching import BatchEngine
from gearshift.agents.emulator.config import TRTLLM_DRAIN_GRACE_S, EmulatorOptions
from gearshift.agents.emulator.flavors import register
from gearshift.agents.emulator.iterstats import IterationStats
from gearshift.agents.emulator.metrics import EngineMetrics, TrtllmMetrics


async def json_metrics(request: web.Request) -> web.Response:
    stats = request.app[STATE_KEY].iterstats
    return web.json_response(stats.drain() if stats is not None else [])


async def prometheus(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    # Without return_perf_metrics the real server collects nothing here.
    body = state.metrics.render() if state.args.return_perf_metrics else b""
    return web.Response(body=body, headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})


class TrtllmFlavor:
    name = "tensorrt-llm"
    owned_by = "tensorrt_llm"
    default_capacity_rps = 46.0
    default_version = "1.3.0"

    def parse(self, argv: list[str]) -> EngineArgs:
        return parse_trtllm(argv)

    def make_metrics(self, engine: BatchEngine, args: EngineArgs, options: EmulatorOptions
                     ) -> tuple[EngineMetrics, IterationStats | None]:
        metrics = TrtllmMetrics(model_name=args.served_model_name, engine_type=args.backend,
                                prefixed=options.trtllm_prefixed_names,
                                engine_version=options.engine_version,
                                engine=engine if args.enable_iter_perf_stats else None)
        iterstats = (IterationStats(engine, gpu_memory_fraction=args.gpu_memory_fraction)
                     if args.enable_iter_perf_stats else None)
        return metrics, iterstats

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/metrics", json_metrics), web.get("/prometheus/metrics", prometheus)]

    def drain_grace_s(self, args: EngineArgs) -> float:
        return TRTLLM_DRAIN_GRACE_S


TRTLLM = register(TrtllmFlavor())
