"""Crash injection: the controller is killed (SIGKILL, a real process) right after it saved
a migration's end and before anything updated the migration's decision. After a restart
no decision is left `executing`, and the same move is decided and carried out again
(not suppressed by a stale open decision)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import psutil

from gearshift.controller.failpoints import FAILPOINTS_ENV, MIGRATION_END_SAVED
from gearshift.controller.store.database import SQLITE_DB_FILENAME
from gearshift.devfleet.local_fleet import LocalFleet
from integration.helpers import gateway_load, gearshift_json, wait_for
from integration.moves import _apply, ended, start_moving_hosts

# A long canary, and a target engine that crashes a few seconds after it started: every
# move to TensorRT-LLM ends rolled back, so the policy keeps wanting the same move.
ARGS = ("--history-resolution", "0.5", "--canary-steps", "0.5", "--analysis-intervals", "12")
CRASHING_TARGET = {"GEARSHIFT_EMULATOR_FAULTS": '{"crash_after_s": 6}'}


def _stored(fleet: LocalFleet) -> tuple[dict[str, str], dict[str, str]]:
    """Migration phases and decision statuses as committed in the store, read directly."""
    db = sqlite3.connect(f"file:{fleet.workdir / 'data' / SQLITE_DB_FILENAME}?mode=ro", uri=True)
    try:
        phases = dict(db.execute("SELECT id, phase FROM migrations").fetchall())
        statuses = dict(db.execute("SELECT id, status FROM decisions").fetchall())
    finally:
        db.close()
    return phases, statuses


def _decisions_to_trt(fleet: LocalFleet) -> list[dict]:
    return [d for d in gearshift_json(fleet, "decisions", "list")
            if d["model"] == "m" and d["to_engine"] == "tensorrt-llm"]


def test_killed_between_migration_end_and_decision_update(fleet: LocalFleet,
                                                           tmp_path: Path) -> None:
    fleet.start_controller(ARGS, env={FAILPOINTS_ENV: MIGRATION_END_SAVED})
    start_moving_hosts(fleet, CRASHING_TARGET)
    fleet.start_gateway()
    with gateway_load(fleet.gateway_url, "m"):  # traffic: the policy's rule wants the move
        _crash_and_restart(fleet, tmp_path)


def _crash_and_restart(fleet: LocalFleet, tmp_path: Path) -> None:
    proc = fleet.procs["controller"]
    _apply(fleet, tmp_path, "to-trt", "auto", "tensorrt-llm")
    # The controller stops itself at the failpoint: the end is committed, the decision not.
    ps = psutil.Process(proc.popen.pid)
    wait_for(lambda: ps.status() == psutil.STATUS_STOPPED, 120, "the controller at the failpoint")
    phases, statuses = _stored(fleet)
    assert len(phases) == 1 and len(statuses) == 1, (phases, statuses)
    mig_id, phase = next(iter(phases.items()))
    decision_id = next(iter(statuses))
    assert phase == "rolled_back"
    assert statuses[decision_id] == "executing"
    fleet.procs.pop("controller").kill()  # SIGKILL: no chance to clean up

    fleet.start_controller(ARGS)  # same port, same SQLite file, no failpoint
    first = wait_for(lambda: (d := gearshift_json(fleet, "decisions", "explain", decision_id))
                     and d["status"] != "executing" and d, 60, "the decision settled")
    assert first["status"] == "rolled_back", first
    assert f"migration {mig_id} rolled back" in first["status_reason"]

    # Not suppressed: the policy still wants the move, decides it again and carries it out.
    again = wait_for(lambda: next((d for d in _decisions_to_trt(fleet)
                                   if d["id"] != decision_id), None), 60,
                     "the same move decided again")
    assert again["from_engine"] == "vllm"
    second = wait_for(lambda: next((m for m in gearshift_json(fleet, "migrations", "list")
                                    if m["decision_id"] == again["id"]), None), 60,
                      "a migration for the new decision")
    wait_for(lambda: ended(fleet, second["id"]), 120, "the new move to end")
    done = wait_for(lambda: (d := gearshift_json(fleet, "decisions", "explain", again["id"]))
                    and d["status"] != "executing" and d, 30, "the new decision settled")
    assert done["status"] == "rolled_back", done  # its target crashed too
