"""The vLLM flavour of the emulator: `vllm serve` arguments, `vllm:` metrics on `/metrics`.

On SIGTERM, vLLM lets in-flight requests finish for `--shutdown-timeout` seconds
and aborts them at once without it. Sleep mode as in vLLM's docs
(docs/features/sleep_mode.md): `POST /sleep?level=1|2`, `POST /wake_up`, `GET
/is_sleeping` (the real server mounts them only with `VLLM_SERVER_DEV_MODE=1`);
while asleep, generation answers 503 and `vllm:engine_sleep_state` says which level.
"""

from __future__ import annotations

from aiohttp import web

from gearshift.agents.emulator.app import STATE_KEY, prometheus_metrics
from gearshift.agents.emulator.args import EngineArgs, parse_vllm
from gearshift.agents.emulator.batching import BatchEngine
from gearshift.agents.emulator.config import EmulatorOptions
from gearshift.agents.emulator.flavors import register
from gearshift.agents.emulator.iterstats import IterationStats
from gearshift.agents.emulator.metrics import EngineMetrics, VllmMetrics


async def sleep(request: web.Request) -> web.Response:
    level = request.query.get("level", "1")
    if level not in ("1", "2"):
        raise web.HTTPBadRequest(text=f"level must be 1 or 2, got {level!r}")
    request.app[STATE_KEY].engine.sleep_level = int(level)
    return web.Response(status=200)


async def wake_up(request: web.Request) -> web.Response:
    request.app[STATE_KEY].engine.sleep_level = 0
    return web.Response(status=200)


async def is_sleeping(request: web.Request) -> web.Response:
    return web.json_response({"is_sleeping": request.app[STATE_KEY].engine.sleep_level > 0})


class VllmFlavor:
    name = "vllm"
    owned_by = "vllm"
    default_capacity_rps = 40.0
    default_version = "0.33.0"  # the newest release of the version table

    def parse(self, argv: list[str]) -> EngineArgs:
        return parse_vllm(argv)

    def make_metrics(self, engine: BatchEngine, args: EngineArgs, options: EmulatorOptions
                     ) -> tuple[EngineMetrics, IterationStats | None]:
        return VllmMetrics(engine, model_name=args.served_model_name,
                           gpu_memory_fraction=args.gpu_memory_fraction,
                           engine_version=options.engine_version), None

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/metrics", prometheus_metrics), web.post("/sleep", sleep),
                web.post("/wake_up", wake_up), web.get("/is_sleeping", is_sleeping)]

    def drain_grace_s(self, args: EngineArgs) -> float:
        return args.shutdown_timeout_s or 0.0


VLLM = register(VllmFlavor())
