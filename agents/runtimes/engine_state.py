"""What the agent knows of each engine it started, kept on disk so a new agent can adopt it.

Engines outlive their agent (fail static: upgrading or restarting the agent is
no outage). For each engine it spawns, the agent writes one small JSON record
into its work dir: the pid, the process start time (from the kernel, so a
recycled pid never passes for the engine), the port and host it serves on and
the spec it runs. Records are written atomically (temporary file, fsync,
rename): a crash in the middle leaves the previous record or the new one,
never half of one.

A restarted agent reads the records and classifies each one:

- `ALIVE`: a process with that pid and that start time runs: it is the engine
  this agent's predecessor started (the health answer then says how it does);
- `DEAD`: no such process any more: the record is stale and may be removed;
- `INVALID`: the file cannot be read or does not hold a record: left alone
  (nothing it names can be proven to be ours).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import psutil

from gearshift.common.spec import DeploymentSpec

STATE_SUFFIX = ".engine.json"
STATE_VERSION = 1
# /proc start times come from clock ticks (10 ms) and the boot time: equal for one process.
START_TIME_TOLERANCE_S = 0.05


class RecordState(StrEnum):
    """What a record on disk says about its process now."""

    ALIVE = "alive"      # pid runs and started when the record says: the same engine
    DEAD = "dead"        # the engine is gone (or its pid now belongs to another process)
    INVALID = "invalid"  # unreadable record: nothing can be concluded from it


@dataclass(frozen=True)
class EngineRecord:
    """One engine process the agent started."""

    deployment_id: str
    pid: int
    start_time: float           # psutil create_time(): seconds since the epoch
    host: str                   # address the engine binds
    port: int
    spec: dict[str, Any]        # DeploymentSpec fields as JSON
    argv: tuple[str, ...]
    served_model_name: str
    restarts: int = 0

    def deployment_spec(self) -> DeploymentSpec:
        return DeploymentSpec(**self.spec)

    def to_json(self) -> str:
        data = asdict(self)
        data["argv"] = list(self.argv)
        return json.dumps({"version": STATE_VERSION, **data}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EngineRecord:
        data = json.loads(text)
        if not isinstance(data, dict) or data.pop("version", None) != STATE_VERSION:
            raise ValueError(f"not an engine record of version {STATE_VERSION}")
        spec = data.get("spec")
        if not isinstance(spec, dict):
            raise ValueError("spec: expected a mapping")
        record = cls(deployment_id=str(data["deployment_id"]), pid=int(data["pid"]),
                     start_time=float(data["start_time"]), host=str(data["host"]),
                     port=int(data["port"]), spec=spec, argv=tuple(data["argv"]),
                     served_model_name=str(data["served_model_name"]),
                     restarts=int(data.get("restarts", 0)))
        if record.pid <= 1 or not 0 < record.port <= 65535:
            raise ValueError(f"pid {record.pid} or port {record.port} out of range")
        record.deployment_spec()  # validates the spec
        return record


def process_start_time(pid: int) -> float | None:
    """The kernel's start time of `pid` (None when no such process runs)."""
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return None


def record_state(record: EngineRecord) -> RecordState:
    """Is the process the record names still the one that was started?"""
    started = process_start_time(record.pid)
    if started is None or abs(started - record.start_time) > START_TIME_TOLERANCE_S:
        return RecordState.DEAD
    try:
        if psutil.Process(record.pid).status() == psutil.STATUS_ZOMBIE:
            return RecordState.DEAD
    except psutil.Error:
        return RecordState.DEAD
    return RecordState.ALIVE


class EngineStateDir:
    """The records of one agent's engines: `<workdir>/state/<deployment_id>.engine.json`."""

    def __init__(self, workdir: Path | str) -> None:
        self.path = Path(workdir) / "state"

    def file(self, deployment_id: str) -> Path:
        return self.path / f"{deployment_id}{STATE_SUFFIX}"

    def write(self, record: EngineRecord) -> None:
        """Replace the record of `record.deployment_id` atomically."""
        self.path.mkdir(parents=True, exist_ok=True)
        target = self.file(record.deployment_id)
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp-", suffix=STATE_SUFFIX)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(record.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        # The rename is durable only once the directory itself is on disk.
        dir_fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def remove(self, deployment_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.file(deployment_id).unlink()

    def read_all(self) -> list[tuple[Path, EngineRecord | None, str]]:
        """Every record file: (path, record or None when unreadable, why unreadable)."""
        if not self.path.is_dir():
            return []
        out: list[tuple[Path, EngineRecord | None, str]] = []
        for path in sorted(self.path.glob(f"*{STATE_SUFFIX}")):
            if path.name.startswith(".tmp-"):
                continue
            try:
                record = EngineRecord.from_json(path.read_text())
            except (OSError, ValueError, KeyError, TypeError) as exc:
                out.append((path, None, f"{type(exc).__name__}: {exc}"))
                continue
            except Exception as exc:  # an invalid spec (InvalidArgument) and the like
                out.append((path, None, str(exc)))
                continue
            if path.name != f"{record.deployment_id}{STATE_SUFFIX}":
                out.append((path, None, f"names deployment {record.deployment_id!r}"))
                continue
            out.append((path, record, ""))
        return out

    def clean_temporaries(self) -> None:
        """Remove half-written records a crash left (they were never renamed into place)."""
        if self.path.is_dir():
            for tmp in self.path.glob(f".tmp-*{STATE_SUFFIX}"):
                with contextlib.suppress(OSError):
                    tmp.unlink()
