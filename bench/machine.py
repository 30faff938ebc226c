"""How fast the machine was while a bench ran, printed beside the bench's figures.

The benches' targets are CPU figures (cores, seconds of CPU) on a small shared virtual
machine whose speed moves a lot from one hour to the next: the same unchanged plain
backtest has taken 2.6 s of CPU in one session and 7.6 s in another. A figure without
the machine's state beside it cannot be compared with another. `MachineWatch` times a
fixed pure-Python loop (10,000,000 integer additions on a function's locals, the best of
three; `loop_1e7_add_s`) before and after the bench's work, and reads the share of CPU
time the hypervisor took from this guest (`steal`, from /proc/stat through psutil) and
the load average over the run. (The same loop written at a module's top level, on
globals, takes about 2.5 times as long: compare like with like.)

These see a slow core and a busy hypervisor, not a slow memory system: on a machine
whose loop took 0.33 s and whose steal was nil, the benches took 1.4 to 1.9 times the
CPU of their fastest runs (docs/performance.md, "Scale targets: where they stand").
Unchanged code run beside the measured code (the blind bench's plain backtest) sees
both; two runs compare only when they were alternated under one lock.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psutil

LOOP_ADDS = 10_000_000
ROUNDS = 3


def _once() -> float:
    began = time.perf_counter()
    total = 0
    for i in range(LOOP_ADDS):
        total += i
    return time.perf_counter() - began


def loop_s() -> float:
    """Wall seconds of LOOP_ADDS integer additions in this interpreter, best of ROUNDS."""
    return min(_once() for _ in range(ROUNDS))


class MachineWatch:
    """Started before a bench's work and read after it: `result()` is the `machine`
    object of the bench's JSON."""

    def __init__(self) -> None:
        self.loop_before_s = loop_s()
        self._times = psutil.cpu_times()

    def result(self) -> dict[str, Any]:
        times = psutil.cpu_times()
        total = sum(times) - sum(self._times)
        steal = getattr(times, "steal", 0.0) - getattr(self._times, "steal", 0.0)
        return {"cpus": os.cpu_count(),
                "loop_1e7_add_s": [round(self.loop_before_s, 3), round(loop_s(), 3)],
                "steal_share": round(steal / total, 3) if total > 0 else 0.0,
                "load_avg_1m": round(os.getloadavg()[0], 2)}
