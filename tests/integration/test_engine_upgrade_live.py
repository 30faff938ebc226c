"""An engine upgrade under a live controller: the agent restarts on a newer emulated
release (`gearshift emulate --engine-version`) whose capacity differs, and the
controller's next decision names the new release and does not take the old release's
measured capacity for a measurement of it.

A controller and an agent as processes, the CLI as a person runs it. The old release's
capacity is what the controller learned before (stored as the learner stores it: an
hour of rollup minutes, which a test cannot wait for). The policy evaluates only when
asked (`decisions evaluate`), so "the next decision" is the one that call returns.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from gearshift.controller.decisions.learning import CapacityLearner
from gearshift.controller.store.database import Store, default_sqlite_url
from gearshift.controller.store.tables import RollupRow
from gearshift.devfleet.local_fleet import LocalFleet, gearshift_cmd, spawn
from integration.helpers import FAST_ENGINE_ENV, gearshift, gearshift_json, wait_for

GPU = "NVIDIA H100 80GB HBM3"  # LocalFleet's emulated GPUs
OLD, NEW = "0.12.0", "0.18.0"  # rows of vLLM's version table
OLD_CAPACITY_RPS, NEW_CAPACITY_RPS = 10.0, 20.0

# Evaluated only when asked (interval 1h); a rule that fires on any traffic, so that every
# evaluation of m decides (dry-run: recorded, not executed).
POLICY = """\
apiVersion: gearshift.dev/v1
kind: EnginePolicy
metadata: {name: upgrade}
spec:
  mode: dry-run
  interval: 1h
  signals: {window: 4s, longWindow: 8s, minHistory: 2s}
  rules:
    - {name: prefer-trt, kind: threshold, prefer: tensorrt-llm,
       when: [{signal: rps_sustained, ge: 0}]}
  guardrails: {minDwell: 0s}
  models:
    m: {slaTtftP99Ms: 1000, gpusPerReplica: 1}
"""


def learned_before(data_dir: Path) -> None:
    """What the controller had learned of m on vLLM OLD: an hour of one replica from 10% to
    130% of OLD_CAPACITY_RPS, p99 TTFT crossing the SLA at it."""
    rows = []
    for i in range(60):
        load = OLD_CAPACITY_RPS * (0.1 + 1.2 * i / 59)
        rows.append(RollupRow(model="m", engine="vllm", engine_version=OLD, gpu_model=GPU,
                              minute=datetime.fromtimestamp(1_773_000_000 + 60 * i, UTC),
                              reports=6, replicas=1, request_rate_mean=load,
                              request_rate_max=load, itl_p99_s=0.02,
                              ttft_p99_s=0.1 + 0.9 * (load / OLD_CAPACITY_RPS) ** 4))
    store = Store.open(default_sqlite_url(data_dir))
    try:
        learner = CapacityLearner(store)
        assert learner.observe(rows) == 60
        learner.save()
    finally:
        store.close()


def start_agent(fleet: LocalFleet, version: str, capacity_rps: float) -> None:
    """host-a serving m on vLLM `version`, emulated as that release with that capacity."""
    path = fleet.agent_config("host-a", [{"deployment_id": "m-vllm-0", "model": "m",
                                          "engine": "vllm", "source": "org/m",
                                          "gpu_indices": [0]}], FAST_ENGINE_ENV)
    config = yaml.safe_load(path.read_text())
    config["engines"]["vllm"].update(
        executable=gearshift_cmd("emulate", "--flavor", "vllm", "--engine-version", version,
                                 "--"),
        version=version,
        env={**FAST_ENGINE_ENV["vllm"], "GEARSHIFT_EMULATOR_CAPACITY_RPS": str(capacity_rps)})
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    fleet.procs["host-a"] = spawn("host-a", gearshift_cmd("agent", "--config", str(path)),
                                  fleet.workdir)

    def ready() -> bool:
        return any(d["report"]["model"] == "m" and d["report"]["engine_version"] == version
                   and d["report"]["phase"] == "DEPLOYMENT_PHASE_READY"
                   for d in gearshift_json(fleet, "fleet", "deployments"))

    wait_for(ready, 60, f"m ready on vLLM {version}")


def next_decision(fleet: LocalFleet) -> dict[str, Any]:
    """The first decision `decisions evaluate` returns for m (an evaluation before m has
    `minHistory` of traffic returns none)."""
    def decided() -> dict[str, Any] | None:
        found = gearshift_json(fleet, "decisions", "evaluate").get("decisions", [])
        return next((d for d in found if d["model"] == "m"), None)

    return wait_for(decided, 30, "a decision for m")


def test_the_decision_after_an_upgrade_names_the_release_and_measures_nothing_on_it(
        fleet: LocalFleet, tmp_path: Path) -> None:
    """Cost: about 10 s (a controller, an agent started twice, a dozen CLI calls)."""
    learned_before(fleet.workdir / "data")
    fleet.start_controller(("--history-resolution", "0.5"))
    policy = tmp_path / "upgrade.yaml"
    policy.write_text(POLICY)
    gearshift(fleet, "policy", "apply", str(policy))

    start_agent(fleet, OLD, OLD_CAPACITY_RPS)
    before = next_decision(fleet)
    i = before["inputs"]
    assert i["engine_version.vllm"] == OLD
    assert i["capacity_source.vllm"] == "measured"
    assert abs(i["capacity_rps.vllm"] - OLD_CAPACITY_RPS) < 0.1 * OLD_CAPACITY_RPS
    gearshift(fleet, "decisions", "reject", before["id"], "--reason", "the engine is upgraded")

    fleet.procs.pop("host-a").terminate()
    start_agent(fleet, NEW, NEW_CAPACITY_RPS)
    after = next_decision(fleet)
    i = after["inputs"]
    assert i["engine_version.vllm"] == NEW
    assert i["capacity_source.vllm"] == "earlier-release"  # a prior: not measured
    assert i["capacity_points.vllm"] == 0
    assert i["capacity_note.vllm"].startswith(f"vllm {NEW}: not measured; prior from {OLD}")
    assert i["capacity_low.vllm"] < before["inputs"]["capacity_low.vllm"]  # band widened
    assert i["capacity_high.vllm"] > before["inputs"]["capacity_high.vllm"]
    explained = gearshift(fleet, "decisions", "explain", after["id"]).stdout
    assert f"capacity on vllm {NEW}:" in explained and "NOT MEASURED on this release" in explained
