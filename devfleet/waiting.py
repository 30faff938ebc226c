"""Waiting for a condition or a ready file, with a deadline and the last error in the message."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def wait_for(fn: Callable[[], T | None], timeout_s: float = 30.0, what: str = "condition",
             interval_s: float = 0.2) -> T:
    """Poll `fn` until it returns something truthy (an exception counts as not yet)."""
    deadline = time.monotonic() + timeout_s
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = fn()
            if value:
                return value
        except Exception as exc:  # the thing waited for may not answer yet
            last_exc = exc
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}; "
                       f"last error: {last_exc!r}")


def wait_file(path: Path, alive: Callable[[], bool], describe: Callable[[], str],
              timeout_s: float) -> str:
    """The stripped text of `path` once a process wrote it; raises when the process
    (`alive`) died first or the deadline passed (`describe`: its name and log tail)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        if not alive():
            raise RuntimeError(f"{describe()} exited before writing {path.name}")
        time.sleep(0.05)
    raise TimeoutError(f"{describe()} did not write {path.name} within {timeout_s}s")


__all__ = ["wait_file", "wait_for"]
