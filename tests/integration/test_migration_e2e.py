"""A model moves between vLLM and TensorRT-LLM under continuous client load through
the gateway: a policy proposes it, a person approves it, the orchestrator carries
it out through a canary, and no client request fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from gearshift.devfleet.local_fleet import LocalFleet
from integration.helpers import gateway_load, gearshift, gearshift_json, wait_for
from integration.moves import (
    END_PHASES,
    POLICY,
    _apply,
    _engines,
    _migration_done,
    start_moving_fleet,
)

CONTROLLER_ARGS = ("--history-resolution", "0.5", "--canary-steps", "0.5",
                   "--analysis-intervals", "2")


@pytest.fixture
def moving_fleet(fleet: LocalFleet) -> LocalFleet:
    return start_moving_fleet(fleet, CONTROLLER_ARGS)


def test_move_to_tensorrt_llm_and_back_with_zero_failed_requests(moving_fleet: LocalFleet,
                                                                  tmp_path: Path) -> None:
    fleet = moving_fleet
    with gateway_load(fleet.gateway_url, "m") as load:
        _apply(fleet, tmp_path, "to-trt", "approve", "tensorrt-llm")
        decision = wait_for(lambda: next(
            (d for d in gearshift_json(fleet, "decisions", "list")
             if d["status"] == "proposed" and d["to_engine"] == "tensorrt-llm"), None),
            40, "a proposed decision to move m to tensorrt-llm")
        explained = gearshift(fleet, "decisions", "explain", decision["id"]).stdout
        assert "prefer-tensorrt-llm" in explained and "m" in explained
        assert _engines(fleet) == {"vllm"}  # approve mode: nothing moved yet

        gearshift(fleet, "decisions", "approve", decision["id"])
        done = wait_for(lambda: _migration_done(fleet, "tensorrt-llm"), 120, "the move to finish")
        assert done["phase"] == "done", done
        wait_for(lambda: _engines(fleet) == {"tensorrt-llm"}, 30, "only tensorrt-llm serving m")
        shown = gearshift_json(fleet, "migrations", "show", done["id"])
        phases = [s["to_phase"] for s in shown["steps"]]
        for phase in ("starting", "warming", "canary", "promoting", "draining", "done"):
            assert phase in phases, phases
        d = gearshift_json(fleet, "decisions", "list")
        assert next(x for x in d if x["id"] == decision["id"])["status"] == "done"

        # And back, in auto mode: no approval needed.
        _apply(fleet, tmp_path, "to-vllm", "auto", "vllm")
        back = wait_for(lambda: _migration_done(fleet, "vllm"), 120, "the move back to finish")
        assert back["phase"] == "done", back
        wait_for(lambda: _engines(fleet) == {"vllm"}, 30, "only vllm serving m")
    assert load.sent > 50
    assert load.failed == 0, load.errors[:5]


def test_trial_measures_the_target_before_the_move(moving_fleet: LocalFleet, tmp_path: Path) -> None:
    fleet = moving_fleet
    path = tmp_path / "trial.yaml"
    text = POLICY.format(name="trial", mode="auto", prefer="tensorrt-llm",
                         rule="prefer-tensorrt-llm", cooldown="0s")
    path.write_text(text + "  trials: {enabled: true, share: 0.2}\n")
    with gateway_load(fleet.gateway_url, "m") as load:
        gearshift(fleet, "policy", "apply", str(path))
        trial = wait_for(lambda: next((m for m in gearshift_json(fleet, "migrations", "list")
                                       if m["kind"] == "trial" and m["phase"] in END_PHASES), None),
                         90, "the trial to end")
        assert trial["phase"] == "done", trial
        assert trial["canary_steps"] == [0.2]
        first = next(d for d in gearshift_json(fleet, "decisions", "list")
                     if d["id"] == trial["decision_id"])
        assert first["status"] == "superseded" and "trial" in first["status_reason"]
        # The next decision cites the trial and the move follows.
        move = wait_for(lambda: next((m for m in gearshift_json(fleet, "migrations", "list")
                                      if m["kind"] == "engine_switch" and m["phase"] in END_PHASES),
                                     None), 90, "the move after the trial")
        assert move["phase"] == "done", move
        decision = gearshift_json(fleet, "decisions", "explain", move["decision_id"])
        assert trial["id"] in decision["inputs"]["trial.tensorrt-llm"]
    assert load.failed == 0, load.errors[:5]
