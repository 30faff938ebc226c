"""Moves under faults, with clients on the gateway throughout: an engine crash during
the canary, the controller killed mid-move, the target's agent killed mid-move."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gearshift.devfleet.local_fleet import LocalFleet
from integration.helpers import (
    FAST_ENGINE_ENV,
    gateway_load,
    gearshift,
    gearshift_json,
    wait_for,
)
from integration.moves import _apply, _engines, _migration_in, ended, start_moving_fleet

# A longer canary leaves time to inject the fault while it runs.
ARGS = ("--history-resolution", "0.5", "--canary-steps", "0.5", "--analysis-intervals", "12")


@pytest.fixture
def moving_fleet(fleet: LocalFleet) -> LocalFleet:
    return start_moving_fleet(fleet, ARGS)


def test_engine_crash_during_canary_rolls_back(fleet: LocalFleet, tmp_path: Path) -> None:
    # The target engine crashes by itself a few seconds after it started: in its canary.
    start_moving_fleet(fleet, ARGS, {"GEARSHIFT_EMULATOR_FAULTS": '{"crash_after_s": 6}'})
    with gateway_load(fleet.gateway_url, "m") as load:
        _apply(fleet, tmp_path, "to-trt", "auto", "tensorrt-llm", cooldown="1h")
        mig = wait_for(lambda: next(iter(gearshift_json(fleet, "migrations", "list")), None),
                       60, "the move to start")
        end = wait_for(lambda: ended(fleet, mig["id"]), 60, "the move to end")
        assert end["phase"] == "rolled_back", end
        assert "restart" in end["reason"] or "crash" in end["reason"], end["reason"]
        wait_for(lambda: _engines(fleet) == {"vllm"}, 30, "m back on vllm only")
    # Only requests already on the crashed engine may fail (streams cut mid-way).
    assert load.failed <= 3, load.errors
    assert load.sent > 30


def test_a_target_that_exits_before_it_is_ready_fails_the_move_at_once(
        fleet: LocalFleet, tmp_path: Path) -> None:
    # host-a's TensorRT-LLM refuses its start (exit 2, naming what is wrong), as a
    # trtllm-serve that cannot read its --config file does.
    start_moving_fleet(fleet, ARGS, {"GEARSHIFT_EMULATOR_FAULTS": '{"no_such_fault": 1}'})
    with gateway_load(fleet.gateway_url, "m", rps=10):  # traffic makes the rule fire
        _apply(fleet, tmp_path, "to-trt", "auto", "tensorrt-llm", cooldown="1h")
        mig = wait_for(lambda: next(iter(gearshift_json(fleet, "migrations", "list")), None),
                       60, "the move to start")
        # Within a restart backoff or two, not at the start's deadline (600 s).
        end = wait_for(lambda: ended(fleet, mig["id"]), 45, "the move to end")
    assert end["phase"] == "rolled_back", end
    assert "exited with code 2" in end["reason"], end["reason"]
    assert "no_such_fault" in end["reason"], end["reason"]  # the engine's last output
    explained = gearshift(fleet, "decisions", "explain", end["decision_id"]).stdout
    assert "exited with code 2" in explained, explained
    assert "exited with code 2" in fleet.procs["host-a"].log()  # and the agent log says why
    assert _engines(fleet) == {"vllm"}


def test_controller_killed_mid_move_resumes_and_finishes(moving_fleet: LocalFleet,
                                                         tmp_path: Path) -> None:
    fleet = moving_fleet
    with gateway_load(fleet.gateway_url, "m") as load:
        _apply(fleet, tmp_path, "to-trt", "auto", "tensorrt-llm")
        mig = wait_for(lambda: _migration_in(fleet, "canary"), 60, "the canary")
        fleet.procs.pop("controller").kill()  # SIGKILL: no chance to clean up
        fleet.start_controller(ARGS)           # same port, same SQLite file
        end = wait_for(lambda: ended(fleet, mig["id"]), 90, "the resumed move to end")
        assert end["phase"] == "done", [(s["to_phase"], s["message"]) for s in end["steps"]]
        wait_for(lambda: _engines(fleet) == {"tensorrt-llm"}, 30, "m on tensorrt-llm only")
    assert load.failed == 0, load.errors[:5]
    # Exactly one target replica was started, however often its command was sent.
    targets = [d for d in gearshift_json(fleet, "fleet", "deployments")
               if d["report"]["model"] == "m"]
    assert len(targets) == 1
    log = (fleet.workdir / "host-b.log").read_text()
    assert log.count("starting tensorrt-llm for m") <= 1 or "seen before" in log


def test_target_agent_killed_mid_move_ends_safely(moving_fleet: LocalFleet, tmp_path: Path) -> None:
    fleet = moving_fleet
    with gateway_load(fleet.gateway_url, "m") as load:
        _apply(fleet, tmp_path, "to-trt", "auto", "tensorrt-llm", cooldown="1h")
        mig = wait_for(lambda: _migration_in(fleet, "canary"), 60, "the canary")
        fleet.procs.pop("host-b").kill()  # its engine runs on, orphaned, as on a real host
        fleet.start_agent("host-b", [], FAST_ENGINE_ENV)
        end = wait_for(lambda: ended(fleet, mig["id"]), 90, "the move to end")
        assert end["phase"] in ("done", "rolled_back"), end
        engines = wait_for(lambda: (e := _engines(fleet)) and len(e) == 1 and e, 30,
                           "m served by one engine")
        assert engines == ({"tensorrt-llm"} if end["phase"] == "done" else {"vllm"})
    assert load.failed == 0, load.errors[:5]
    status = gearshift_json(fleet, "fleet", "status")
    assert status["hosts_connected"] == 2, json.dumps(status)
