"""Shared set-up for tests that move model `m` between engines under load."""

from __future__ import annotations

from pathlib import Path

from gearshift.devfleet.local_fleet import LocalFleet
from integration.helpers import FAST_ENGINE_ENV, gearshift, gearshift_json, wait_for

POLICY = """\
apiVersion: gearshift.dev/v1
kind: EnginePolicy
metadata: {{name: {name}}}
spec:
  mode: {mode}
  interval: 1s
  signals: {{window: 4s, longWindow: 8s, minHistory: 2s}}
  rules:
    - name: {rule}
      kind: threshold
      prefer: {prefer}
      when: [{{signal: rps_sustained, gt: 0.5}}]
  guardrails: {{minDwell: 0s, cooldown: {cooldown}}}
  models:
    m: {{slaTtftP99Ms: 3000, slaItlP99Ms: 500, gpusPerReplica: 1}}
"""
END_PHASES = ("done", "rolled_back", "aborted")


def start_moving_fleet(fleet: LocalFleet, controller_args: tuple[str, ...],
                       host_a_trt_env: dict[str, str] | None = None) -> LocalFleet:
    """m on vLLM on host-a, which has free GPUs (targets surge there first); host-b
    empty; a gateway. `host_a_trt_env` adds emulator settings (faults) to host-a's
    TensorRT-LLM engines."""
    fleet.start_controller(controller_args)
    start_moving_hosts(fleet, host_a_trt_env)
    fleet.start_gateway()
    return fleet


def start_moving_hosts(fleet: LocalFleet, host_a_trt_env: dict[str, str] | None = None) -> None:
    """The agents of `start_moving_fleet`, once m is ready (controllers already up)."""
    env = {**FAST_ENGINE_ENV,
           "tensorrt-llm": {**FAST_ENGINE_ENV["tensorrt-llm"], **(host_a_trt_env or {})}}
    fleet.start_agent("host-a", [{"deployment_id": "m-vllm-0", "model": "m", "engine": "vllm",
                                  "source": "org/m", "revision": "r1", "gpu_indices": [0]}],
                      env)
    fleet.start_agent("host-b", [], FAST_ENGINE_ENV)
    wait_for(lambda: any(d["report"]["phase"] == "DEPLOYMENT_PHASE_READY"
                         for d in gearshift_json(fleet, "fleet", "deployments")), 60, "m ready")


def ended(fleet: LocalFleet, mid: str) -> dict | None:
    """Migration `mid` once it has ended, else None."""
    m = gearshift_json(fleet, "migrations", "show", mid)
    return m if m["phase"] in END_PHASES else None


def _apply(fleet: LocalFleet, tmp_path: Path, name: str, mode: str, prefer: str,
           cooldown: str = "0s") -> None:
    path = tmp_path / f"{name}.yaml"
    path.write_text(POLICY.format(name=name, mode=mode, prefer=prefer, rule=f"prefer-{prefer}",
                                  cooldown=cooldown))
    gearshift(fleet, "policy", "apply", str(path))


def _engines(fleet: LocalFleet) -> set[str]:
    return {d["report"]["engine"] for d in gearshift_json(fleet, "fleet", "deployments")
            if d["report"]["model"] == "m"}


def _migration_done(fleet: LocalFleet, to_engine: str) -> dict | None:
    for m in gearshift_json(fleet, "migrations", "list"):
        if m["to_engine"] == to_engine and m["phase"] in END_PHASES:
            return m
    return None


def _migration_in(fleet: LocalFleet, phase: str) -> dict | None:
    for m in gearshift_json(fleet, "migrations", "list"):
        if m["phase"] == phase:
            return m
    return None
