"""Engine records on disk and the hand-over between agents, against real processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gearshift.agents.handover import WorkdirLock, clean_up_dead, drain_recorded, survey
from gearshift.agents.runtimes.adopted import AdoptedProcess
from gearshift.agents.runtimes.engine_state import (
    EngineRecord,
    EngineStateDir,
    RecordState,
    process_start_time,
    record_state,
)
from gearshift.common.errors import FailedPrecondition

SPEC = {"deployment_id": "d1", "model": "m", "engine": "vllm", "source": "org/m",
        "gpu_indices": [0]}


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A process in its own session, like an engine."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def _record(pid: int, **overrides: object) -> EngineRecord:
    started = process_start_time(pid)
    assert started is not None
    fields: dict[str, object] = {"deployment_id": "d1", "pid": pid, "start_time": started,
                                 "host": "127.0.0.1", "port": 8000, "spec": dict(SPEC),
                                 "argv": ("vllm", "serve"), "served_model_name": "m"}
    fields.update(overrides)
    return EngineRecord(**fields)  # type: ignore[arg-type]


def test_record_round_trips_and_is_written_atomically(tmp_path: Path,
                                                      sleeper: subprocess.Popen[bytes]) -> None:
    state = EngineStateDir(tmp_path)
    record = _record(sleeper.pid, restarts=2)
    state.write(record)
    [(path, read, why)] = state.read_all()
    assert read == record and why == ""
    assert path == state.file("d1")
    assert read.deployment_spec().gpu_indices == (0,)
    assert [p.name for p in state.path.iterdir()] == ["d1.engine.json"]  # no temporaries


def test_a_live_process_with_its_start_time_is_alive(sleeper: subprocess.Popen[bytes]) -> None:
    assert record_state(_record(sleeper.pid)) is RecordState.ALIVE


def test_another_start_time_means_a_recycled_pid(sleeper: subprocess.Popen[bytes]) -> None:
    record = _record(sleeper.pid)
    recycled = _record(sleeper.pid, start_time=record.start_time - 100.0)
    assert record_state(recycled) is RecordState.DEAD


def test_an_exited_process_is_dead(sleeper: subprocess.Popen[bytes]) -> None:
    record = _record(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    assert record_state(record) is RecordState.DEAD


def test_survey_sorts_records_and_leaves_unreadable_ones(tmp_path: Path,
                                                         sleeper: subprocess.Popen[bytes]) -> None:
    state = EngineStateDir(tmp_path)
    state.write(_record(sleeper.pid))
    gone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    state.write(_record(gone.pid, deployment_id="d2", spec={**SPEC, "deployment_id": "d2"}))
    gone.kill()
    gone.wait()
    bad = state.path / "d3.engine.json"
    bad.write_text("{not json")
    half = state.path / ".tmp-x.engine.json"
    half.write_text("{")
    found = survey(state)
    assert [r.deployment_id for r in found.alive] == ["d1"]
    assert [r.deployment_id for r in found.dead] == ["d2"]
    assert [p.name for p, _ in found.invalid] == ["d3.engine.json"]
    assert not half.exists()  # a crash mid-write left it: never renamed into place
    for record in found.dead:
        clean_up_dead(state, record)
    assert not state.file("d2").exists() and bad.exists() and state.file("d1").exists()


def test_only_one_agent_per_work_dir(tmp_path: Path) -> None:
    with WorkdirLock(tmp_path), pytest.raises(FailedPrecondition, match="in use by another"):
        WorkdirLock(tmp_path).acquire()
    with WorkdirLock(tmp_path):  # released: free again
        pass


def test_drain_recorded_stops_live_engines_and_removes_records(
        tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    state = EngineStateDir(tmp_path)
    state.write(_record(sleeper.pid))
    lines = drain_recorded(tmp_path, grace_s=5.0)
    assert lines == [f"d1: pid {sleeper.pid} stopped"]
    assert sleeper.wait(5) is not None
    assert state.read_all() == []


async def test_adopted_process_sees_its_exit_and_signals_it(
        sleeper: subprocess.Popen[bytes]) -> None:
    started = process_start_time(sleeper.pid)
    assert started is not None
    proc = AdoptedProcess(sleeper.pid, started)
    waiter = asyncio.ensure_future(proc.wait())
    await asyncio.sleep(0.1)
    assert not waiter.done()
    proc.send_signal(15)
    await asyncio.get_running_loop().run_in_executor(None, sleeper.wait)
    assert await asyncio.wait_for(waiter, 5) == -1  # the status went to the real parent
    proc.close()


async def test_adopting_a_recycled_pid_sees_an_exited_engine(
        sleeper: subprocess.Popen[bytes]) -> None:
    started = process_start_time(sleeper.pid)
    assert started is not None
    proc = AdoptedProcess(sleeper.pid, started - 100.0)
    assert await asyncio.wait_for(proc.wait(), 5) == -1
    proc.send_signal(9)  # must not reach the process that now has the pid
    assert sleeper.poll() is None
    proc.close()
