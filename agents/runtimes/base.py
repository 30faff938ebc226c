"""The engine runtime seam: how to launch an engine and where to watch it.

An `EngineRuntime` turns a `DeploymentSpec` into the engine's REAL command line
(docs/engines.md). Where the engine serves health and metrics, and what a health
answer means, are the engine catalog's (`gearshift.common.engines`):
`endpoints_for` and `classify_health` read them. Runtimes register by name in
`RUNTIMES`; `get_runtime` imports the module the catalog entry names and rejects
unknown names with the list of known ones.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Protocol

from gearshift.common.engine_versions import EngineRelease, release_for
from gearshift.common.engines import ENGINE_NAMES, HealthSemantics, engine_entry
from gearshift.common.errors import InvalidArgument
from gearshift.common.spec import DeploymentSpec


class HealthState(StrEnum):
    """What one health probe says about the engine."""

    LOADING = "loading"  # connection refused: the engine has not bound its port yet
    READY = "ready"      # 200
    DEAD = "dead"        # 503 or another error status: the engine is up but broken


@dataclass(frozen=True)
class LaunchPlan:
    """Everything needed to start the engine process."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # added to the agent's environment
    served_model_name: str = ""                           # the name clients send as "model"
    files: tuple[Path, ...] = ()                          # files written for this launch


@dataclass(frozen=True)
class EngineEndpoints:
    """URLs of a running engine, for the supervisor and the metric scrapers."""

    base_url: str
    health_urls: tuple[str, ...]  # the first decides readiness
    metric_urls: tuple[str, ...]  # the catalog entry's metric endpoints, in its order
    models_url: str = ""


class EngineRuntime(Protocol):
    """How one engine kind is launched (named like its catalog entry)."""

    name: str

    def launch_plan(self, spec: DeploymentSpec, *, executable: list[str], host: str,
                    port: int, workdir: Path, release: EngineRelease | None = None
                    ) -> LaunchPlan:
        """The command line (and env, files) that starts `spec` on `host:port`, in the
        flags of `release` (the version-table row of the host's engine; None = the newest)."""
        ...


def release_or_newest(engine: str, release: EngineRelease | None) -> EngineRelease:
    """`release`, or the newest row of `engine`'s version table."""
    return release if release is not None else release_for(engine, "").row


def endpoints_for(engine: str, base_url: str) -> EngineEndpoints:
    """Health and metrics URLs of `engine` served at `base_url`, from its catalog entry."""
    entry = engine_entry(engine)
    base = base_url.rstrip("/")
    return EngineEndpoints(base_url=base,
                           health_urls=tuple(base + p for p in entry.health.paths),
                           metric_urls=tuple(base + ep.path for ep in entry.metric_endpoints),
                           models_url=f"{base}/v1/models")


def classify_health(health: HealthSemantics, status: int | None, *,
                    ready_before: bool) -> HealthState:
    """One health probe by the entry's semantics: `None` = connection refused, else the
    HTTP status. `ready_before`: the engine has answered ready since it started."""
    if status is None:
        return HealthState.LOADING
    if status == 200:
        return HealthState.READY
    if status in health.loading_statuses and not ready_before:
        return HealthState.LOADING
    return HealthState.DEAD


def cuda_env(spec: DeploymentSpec) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES from the spec's GPU indices (nothing when none are given)."""
    if not spec.gpu_indices:
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in spec.gpu_indices)}


RUNTIMES: dict[str, EngineRuntime] = {}


def register(runtime: EngineRuntime) -> EngineRuntime:
    """Register a runtime under its name (import time)."""
    if runtime.name in RUNTIMES:
        raise ValueError(f"engine runtime {runtime.name!r} is already registered")
    RUNTIMES[runtime.name] = runtime
    return runtime


def get_runtime(name: str) -> EngineRuntime:
    """The runtime of engine `name`; InvalidArgument listing the known engines otherwise."""
    if name not in RUNTIMES:
        entry = engine_entry(name, "engine runtime")
        importlib.import_module(entry.launch.runtime_module)  # registers it
    try:
        return RUNTIMES[name]
    except KeyError:
        raise InvalidArgument(
            f"engine runtime {name!r}: its module {engine_entry(name).launch.runtime_module} "
            f"registered none; known engines: {', '.join(ENGINE_NAMES)}") from None
