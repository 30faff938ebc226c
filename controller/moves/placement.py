"""Where a move's target replicas go: pure functions of the fleet view.

Each source replica gets one target replica. A target surges onto a host with
enough free GPUs (inventory minus the GPUs of the host's deployments and of
other moves' planned targets). When none is free it *replaces* a source replica
on the source's own GPUs; at most ``sources - min_available`` replicas are
replaced before the canary, the rest one by one after promotion.
"""

from __future__ import annotations

import builtins
import dataclasses
import re
from typing import TYPE_CHECKING, Any

from gearshift.common.engines import engine_entry
from gearshift.common.spec import DeploymentSpec
from gearshift.controller.ingest.fleet import FleetState
from gearshift.controller.moves.store import MigrationRow
from gearshift.v1 import agent_pb2, control_pb2

if TYPE_CHECKING:
    from gearshift.controller.moves.orchestrator import OrchestratorSettings


class Paused(Exception):
    """The move waits (unreachable host, no capacity); the message says for what."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _spec_dict(spec: DeploymentSpec) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(spec).items()}


def source_spec(host_id: str, dep: agent_pb2.DeploymentReport, grace_s: float) -> dict[str, Any]:
    """What it takes to start a source replica again (rollback after it was replaced)."""
    spec = DeploymentSpec(
        deployment_id=dep.deployment_id, model=dep.model, engine=dep.engine,
        source=dep.source or dep.model, revision=dep.revision, backend=dep.backend if engine_entry(dep.engine).backends else "",
        tensor_parallel_size=dep.tensor_parallel_size or max(1, len(dep.gpu_indices)),
        gpu_indices=tuple(dep.gpu_indices),
        shutdown_timeout_s=grace_s if engine_entry(dep.engine).drains_gracefully else 0.0)
    return {"host_id": host_id, "spec": _spec_dict(spec)}


def fleet_view(fleet: FleetState, row: MigrationRow,
               active: builtins.list[MigrationRow]) -> dict[str, builtins.list[int]]:
    """Free GPU indices per reachable host that has the target engine (or lists none)."""
    reserved: dict[str, set[int]] = {}
    for other in active:
        if other.id == row.id:
            continue
        for t in other.target_specs:
            reserved.setdefault(t["host_id"], set()).update(t["spec"]["gpu_indices"])
    view: dict[str, builtins.list[int]] = {}
    for host_id, entry in sorted(fleet.hosts.items()):
        if fleet.host_state(host_id) != control_pb2.HOST_STATE_CONNECTED:
            continue
        engines = {e.engine for e in entry.hello.engines}
        if engines and row.to_engine not in engines:
            continue
        gpus = {g.index for g in entry.gpus if g.health != agent_pb2.GPU_HEALTH_FAILED}
        used = set(reserved.get(host_id, set()))
        for dep in entry.deployments.values():
            if dep.phase != agent_pb2.DEPLOYMENT_PHASE_STOPPED:
                used.update(dep.gpu_indices)
        view[host_id] = sorted(gpus - used)
    return view


def place_targets(row: MigrationRow, view: dict[str, builtins.list[int]],
                  settings: OrchestratorSettings) -> builtins.list[dict[str, Any]]:
    """One target replica per source replica: surge where GPUs are free, else replace."""
    free = {h: builtins.list(v) for h, v in view.items()}
    n = len(row.source_specs)
    early_budget = max(0, n - settings.min_available)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", row.model).strip("-._")[:48] or "model"
    entry = engine_entry(row.to_engine)
    tag = entry.launch.deployment_tag
    targets = []
    for i, src in enumerate(row.source_specs):
        sspec = src["spec"]
        need = (settings.gpus_per_replica if settings.gpus_per_replica is not None
                else len(sspec["gpu_indices"]))
        dep_id = f"{slug}-{tag}-{row.id.removeprefix('m-')}-{i}"
        hosts = sorted((h for h in free if len(free[h]) >= need),
                       key=lambda h: (h != src["host_id"], -len(free[h]), h))
        replaces, late = None, False
        if hosts:
            host, gpus = hosts[0], free[hosts[0]][:need]
            del free[host][:need]
        else:
            host = src["host_id"]
            if host not in view or len(sspec["gpu_indices"]) < need:
                raise Paused(f"waiting for capacity: no host has {need} free GPU(s) for {dep_id}"
                             f" and source host {host} is unreachable, lacks {row.to_engine} or "
                             "has too few GPUs")
            gpus, replaces = sspec["gpu_indices"][:need], sspec["deployment_id"]
            late = early_budget <= 0
            early_budget -= 0 if late else 1
        spec = DeploymentSpec(
            deployment_id=dep_id, model=sspec["model"], source=sspec.get("source") or sspec["model"],
            engine=row.to_engine,
            revision=row.target_revision or sspec["revision"],
            backend=entry.backend_for(settings.trtllm_backend),
            tensor_parallel_size=max(1, need), gpu_indices=tuple(gpus),
            shutdown_timeout_s=settings.drain_grace_s if entry.drains_gracefully else 0.0)
        targets.append({"replica": i, "host_id": host, "replaces": replaces, "late": late,
                        "spec": _spec_dict(spec)})
    if all(t["late"] for t in targets):
        raise Paused(f"waiting for capacity: no free GPUs for a surge replica, and replacing one "
                     f"of the {n} source replica(s) would leave fewer than "
                     f"min_available={settings.min_available} serving")
    return targets
