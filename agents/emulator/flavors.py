"""Emulator flavours: one per catalog engine, each in its own module.

A flavour knows its engine's real command line (`parse`), the metrics it
exposes (`make_metrics`), the HTTP paths it serves beyond the shared OpenAI API
(`routes`: health and metrics, in the engine's own paths and formats) and how
long it lets in-flight requests finish on SIGTERM (`drain_grace_s`). The module
of each flavour is named by the engine's catalog entry (`emulator_module`) and
registers itself on import; `get_flavor` imports it on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

from gearshift.common.engines import ENGINE_NAMES, engine_entry
from gearshift.common.errors import InvalidArgument

if TYPE_CHECKING:
    from aiohttp import web

    from gearshift.agents.emulator.args import EngineArgs
    from gearshift.agents.emulator.batching import BatchEngine
    from gearshift.agents.emulator.config import EmulatorOptions
    from gearshift.agents.emulator.iterstats import IterationStats
    from gearshift.agents.emulator.metrics import EngineMetrics


class EmulatorFlavor(Protocol):
    """One emulated engine kind, named like its catalog entry."""

    name: str
    owned_by: str                 # `owned_by` of the served model on /v1/models
    default_capacity_rps: float   # requests/s at which the queue saturates
    default_version: str          # reported on /version and in the info metric

    def parse(self, argv: list[str]) -> EngineArgs:
        """Read the argv the real executable would get; `EngineArgsError` when invalid."""
        ...

    def make_metrics(self, engine: BatchEngine, args: EngineArgs, options: EmulatorOptions
                     ) -> tuple[EngineMetrics, IterationStats | None]:
        """The Prometheus metrics container, and iteration stats if the engine has them."""
        ...

    def routes(self) -> list[web.RouteDef]:
        """Health and metric paths (handlers read the shared state from the app)."""
        ...

    def drain_grace_s(self, args: EngineArgs) -> float:
        """How long in-flight requests may run after SIGTERM (0: abort them)."""
        ...


FLAVORS: dict[str, EmulatorFlavor] = {}


def register(flavor: EmulatorFlavor) -> EmulatorFlavor:
    """Register a flavour under its engine name (import time)."""
    if flavor.name in FLAVORS:
        raise ValueError(f"emulator flavour {flavor.name!r} is already registered")
    FLAVORS[flavor.name] = flavor
    return flavor


def get_flavor(name: str) -> EmulatorFlavor:
    """The flavour of engine `name`; `InvalidArgument` listing the known engines otherwise."""
    if name not in FLAVORS:
        importlib.import_module(engine_entry(name, "emulator flavour").emulator_module)
    try:
        return FLAVORS[name]
    except KeyError:
        raise InvalidArgument(f"emulator flavour {name!r}: its module registered none; "
                              f"known engines: {', '.join(ENGINE_NAMES)}") from None
