"""The engine runtime seam: how to launch an engine and where to watch it.

An `EngineRuntime` turns a `DeploymentSpec` into the engine's REAL command line
(DESIGN §4) and says which URLs carry its health and metrics and what a health
answer means. Runtimes register by name in `RUNTIMES`; `get_runtime` rejects
unknown names with the list of known ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Protocol

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
    health_urls: tuple[str, ...]         # the first decides readiness
    prometheus_url: str                  # Prometheus text
    json_metrics_url: str | None = None  # trtllm-serve iteration stats (drained on read)
    models_url: str = ""


class EngineRuntime(Protocol):
    """How one engine kind is launched and watched."""

    name: str
    default_executable: tuple[str, ...]

    def launch_plan(self, spec: DeploymentSpec, *, executable: list[str], host: str,
                    port: int, workdir: Path) -> LaunchPlan:
        """The command line (and env, files) that starts `spec` on `host:port`."""
        ...

    def endpoints(self, base_url: str) -> EngineEndpoints:
        """Health and metrics URLs of an engine served at `base_url`."""
        ...

    def health_state(self, status: int | None) -> HealthState:
        """Interpret a health probe: `None` = connection refused, else the HTTP status."""
        ...


def classify_health(status: int | None) -> HealthState:
    """Shared rule of vLLM and trtllm-serve: refused = loading, 200 = ready, else dead."""
    if status is None:
        return HealthState.LOADING
    if status == 200:
        return HealthState.READY
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
    """The runtime registered as `name`; InvalidArgument listing the known names otherwise."""
    # Importing the package registers the built-in runtimes.
    import gearshift.agents.runtimes.trtllm
    import gearshift.agents.runtimes.vllm  # noqa: F401

    try:
        return RUNTIMES[name]
    except KeyError:
        raise InvalidArgument(
            f"unknown engine runtime {name!r}; known: {', '.join(sorted(RUNTIMES))}") from None
