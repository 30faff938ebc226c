"""Handing engines over from one agent to the next on the same host.

An agent holds an exclusive lock on its work dir while it runs (two agents
adopting the same engines would fight over them); the kernel drops the lock
when the agent dies, however it dies. At start the new agent surveys the
engine records its predecessor left (`engine_state`): live engines are
adopted, records of dead ones are removed, together with any of their worker
processes still running (members of the dead engine's session that started
after it: provably its own, as a session id is not reused while a member
lives). Nothing else is touched.

`drain_recorded` is the explicit "stop the engines of this host" for a host
whose agent is stopped (decommissioning, maintenance): SIGTERM to each recorded
engine, SIGKILL to its process group after the grace.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil

from gearshift.agents.runtimes.engine_state import (
    EngineRecord,
    EngineStateDir,
    RecordState,
    record_state,
)
from gearshift.common.errors import FailedPrecondition

log = logging.getLogger(__name__)

LOCK_NAME = "agent.lock"
DRAIN_POLL_S = 0.1


class WorkdirLock:
    """`flock` on `<workdir>/agent.lock`, held for the agent's lifetime."""

    def __init__(self, workdir: Path | str) -> None:
        self.path = Path(workdir) / LOCK_NAME
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = self.path.open("a+")  # held open until release()
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise FailedPrecondition(
                f"work dir {self.path.parent} is in use by another agent (pid {holder}); "
                "one agent per work dir") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing drops the lock
            self._file = None

    def __enter__(self) -> WorkdirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class Survey:
    """What the records in a work dir say, one list per `RecordState`."""

    alive: list[EngineRecord] = field(default_factory=list)
    dead: list[EngineRecord] = field(default_factory=list)
    invalid: list[tuple[Path, str]] = field(default_factory=list)


def survey(state: EngineStateDir) -> Survey:
    state.clean_temporaries()
    out = Survey()
    for path, record, why in state.read_all():
        if record is None:
            out.invalid.append((path, why))
        elif record_state(record) is RecordState.ALIVE:
            out.alive.append(record)
        else:
            out.dead.append(record)
    return out


def leftover_workers(record: EngineRecord) -> list[psutil.Process]:
    """Processes of a dead engine's session that started after it: its workers."""
    found = []
    for proc in psutil.process_iter(["pid", "create_time"]):
        try:
            if proc.pid == record.pid or os.getsid(proc.pid) != record.pid:
                continue
            if (proc.info["create_time"] or 0.0) + 0.05 >= record.start_time:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


def clean_up_dead(state: EngineStateDir, record: EngineRecord) -> int:
    """Kill what is left of a dead engine and remove its record; returns processes killed."""
    killed = 0
    for proc in leftover_workers(record):
        with contextlib.suppress(psutil.Error):
            proc.kill()
            killed += 1
    state.remove(record.deployment_id)
    return killed


def drain_recorded(workdir: Path | str, grace_s: float) -> list[str]:
    """Stop every engine recorded in `workdir` (the agent must not be running).

    Returns one line per record saying what was done."""
    state = EngineStateDir(workdir)
    lines: list[str] = []
    with WorkdirLock(workdir):
        found = survey(state)
        for record in found.dead:
            killed = clean_up_dead(state, record)
            lines.append(f"{record.deployment_id}: was not running (record removed"
                         + (f", {killed} leftover worker(s) killed)" if killed else ")"))
        for record in found.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        pending = list(found.alive)
        while pending and time.monotonic() < deadline:
            pending = [r for r in pending if record_state(r) is RecordState.ALIVE]
            if pending:
                time.sleep(DRAIN_POLL_S)
        for record in found.alive:
            forced = record in pending
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if forced or leftover_workers(record):
                    os.killpg(record.pid, signal.SIGKILL)
            clean_up_dead(state, record)
            lines.append(f"{record.deployment_id}: pid {record.pid} stopped"
                         + (f" (killed after {grace_s:g} s grace)" if forced else ""))
        for path, why in found.invalid:
            lines.append(f"{path}: unreadable record left alone ({why})")
    return lines
