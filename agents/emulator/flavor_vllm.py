"""The vLLM flavour of the emulator: `vllm serve` arguments, `vllm:` metrics on `/metrics`.

On SIGTERM, vLLM lets in-flight requests finish for `--shutdown-timeout` seconds
and aborts them at once without it.
"""

from __future__ import annotations

from aiohttp import web

from gearshift.agents.emulator.app import prometheus_metrics
from gearshift.agents.emulator.args import EngineArgs, parse_vllm
from gearshift.agents.emulator.batching import BatchEngine
from gearshift.agents.emulator.config import EmulatorOptions
from gearshift.agents.emulator.flavors import register
from gearshift.agents.emulator.iterstats import IterationStats
from gearshift.agents.emulator.metrics import EngineMetrics, VllmMetrics


class VllmFlavor:
    name = "vllm"
    owned_by = "vllm"
    default_capacity_rps = 40.0
    default_version = "0.11.0"

    def parse(self, argv: list[str]) -> EngineArgs:
        return parse_vllm(argv)

    def make_metrics(self, engine: BatchEngine, args: EngineArgs, options: EmulatorOptions
                     ) -> tuple[EngineMetrics, IterationStats | None]:
        return VllmMetrics(engine, model_name=args.served_model_name,
                           gpu_memory_fraction=args.gpu_memory_fraction,
                           engine_version=options.engine_version), None

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/metrics", prometheus_metrics)]

    def drain_grace_s(self, args: EngineArgs) -> float:
        return args.shutdown_timeout_s or 0.0


VLLM = register(VllmFlavor())
