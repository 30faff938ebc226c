"""Garbage-collector settings for the controller process (ingest latency).

Why this exists: the controller keeps on the order of a hundred tracked Python
objects per agent stream (gRPC's per-call state, the fleet's latest report of
the host) and replaces many of them on every report. Those objects live one
report interval, long enough to be promoted to the oldest generation, so with
CPython's default thresholds a full collection (which walks every tracked
object with the event loop stopped) runs every few tens of seconds; at 5,000
agents that is about a million objects and most of a second without acks.

`GcPolicy.install()` therefore:
- freezes what start-up allocated (`gc.freeze`): modules, classes and the
  like are never walked again;
- keeps the young-generation collections (cheap, they reclaim most cycles) but
  stops the automatic full ones (an unreachable `threshold2`);
- and `run()` (a task on the controller's loop) does a full collection every
  `full_interval_s`, so cyclic garbage that reached the old generation is still
  reclaimed, at a known rate instead of at allocation-driven moments;
- and collects the young generations (0 and 1) every `young_interval_s`.

Why the young collections are timed: CPython starts one when allocations minus
deallocations of tracked objects pass 700, and an ingesting controller allocates about
as many as it frees. Each report replaces what the previous one left (the fleet's
Deployments, the rollups' per-deployment baselines, gRPC's pending read of the stream:
about 30 tracked objects per agent per interval), so the new objects pile up in
generation 0 with the counter near zero. At 10,000 agents the young generation held
about 240,000 objects when a collection finally came, every ten seconds or so, and
walking them stopped the event loop for 150-180 ms: most of the acks over 50 ms. A
collection of generations 0 and 1 every 0.1 s walks what the last 0.1 s allocated
(about 2,400 objects, 1-2 ms), each object once, and moves the survivors to the old
generation, which only the scheduled full collection walks.

The young threshold stays CPython's (700): at 10,000 agents raising it to 7,000 halved
the collector's time (1.6 s to 0.7 s over 40 s) but made each generation-1 collection
25-100 ms instead of a few, each one an ack stall.

- and hands freed heap memory back to the system every `trim_interval_s`
  (glibc's `malloc_trim`, in a worker thread: ctypes releases the GIL). gRPC core's
  threads and the event loop allocate from several malloc arenas, and what a
  connect burst (a fleet's streams queued at once) or a full collection freed
  stays in the process's RSS otherwise: freed chunks in the middle of a heap are
  only returned by a trim. Where the C library has no `malloc_trim` (musl,
  macOS) this does nothing.

Every collection's pause is observed in ``gearshift_controller_gc_pause_seconds``
(by generation). `uninstall()` restores the previous settings (tests run
controllers inside one process). It unfreezes only what `install()` froze: where objects
were already frozen when it was installed (by another owner in the same process), it
cannot tell its own from theirs, so it leaves them all frozen rather than thaw theirs.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

log = logging.getLogger(__name__)

FULL_INTERVAL_S = 600.0
YOUNG_INTERVAL_S = 0.1  # ~2,400 new objects per collection at 10,000 agents: 1-2 ms
TRIM_INTERVAL_S = 30.0  # a trim walks the heap: tens of ms of a worker thread per call
# gc.set_threshold's third value: full collections wait for this many young (generation 1)
# collections, which at any realistic rate is never; `run` collects instead.
NO_AUTOMATIC_FULL = 1 << 30


Trim = Callable[[int], int]  # malloc_trim(pad): 1 if memory was released


def libc_malloc_trim() -> Trim | None:
    """glibc's `malloc_trim`, or None where the C library has none."""
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


LIBC_MALLOC_TRIM = libc_malloc_trim()


class GcPolicy:
    """Freeze start-up objects, stop automatic full collections, collect on a schedule."""

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 full_interval_s: float = FULL_INTERVAL_S,
                 young_interval_s: float = YOUNG_INTERVAL_S,
                 trim_interval_s: float = TRIM_INTERVAL_S,
                 trim: Trim | None = LIBC_MALLOC_TRIM) -> None:
        if full_interval_s <= 0:
            raise ValueError(f"GcPolicy: full_interval_s must be > 0, got {full_interval_s}")
        if young_interval_s <= 0:
            raise ValueError(f"GcPolicy: young_interval_s must be > 0, got {young_interval_s}")
        if trim_interval_s <= 0:
            raise ValueError(f"GcPolicy: trim_interval_s must be > 0, got {trim_interval_s}")
        self.full_interval_s = full_interval_s
        self.young_interval_s = young_interval_s
        self.trim_interval_s = trim_interval_s
        self._trim = trim
        self.pause_seconds = Histogram(
            "gearshift_controller_gc_pause_seconds",
            "Pauses of the Python garbage collector, by generation, in seconds.",
            ["generation"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=registry or CollectorRegistry())
        self._by_generation = [self.pause_seconds.labels(str(g)) for g in range(3)]
        self._started = 0.0
        self._saved: tuple[int, int, int] | None = None
        self._froze_alone = False  # nothing was frozen before `install`: `uninstall` thaws

    def install(self) -> None:
        """Apply the settings (call once start-up allocations are done)."""
        if self._saved is not None:
            return
        self._saved = gc.get_threshold()
        self._froze_alone = gc.get_freeze_count() == 0
        gc.collect()  # freeze live objects only, not garbage
        gc.freeze()
        young0, young1, _ = self._saved
        gc.set_threshold(young0, young1, NO_AUTOMATIC_FULL)
        gc.callbacks.append(self._observe)

    def uninstall(self) -> None:
        if self._saved is None:
            return
        gc.set_threshold(*self._saved)
        self._saved = None
        if self._observe in gc.callbacks:
            gc.callbacks.remove(self._observe)
        if self._froze_alone:
            gc.unfreeze()

    async def run(self) -> None:
        """Full collections every `full_interval_s`, young ones every `young_interval_s`
        and heap trims every `trim_interval_s`, until cancelled."""
        loop = asyncio.get_running_loop()
        next_young = loop.time() + self.young_interval_s
        next_full = loop.time() + self.full_interval_s
        next_trim = loop.time() + self.trim_interval_s
        while True:
            await asyncio.sleep(max(0.0, min(next_young, next_full, next_trim) - loop.time()))
            now = loop.time()
            if now >= next_full:  # walks the young generations too
                next_full = now + self.full_interval_s
                next_young = now + self.young_interval_s
                started = time.perf_counter()
                found = gc.collect()
                log.debug("full garbage collection: %d objects in %.3f s", found,
                          time.perf_counter() - started)
            elif now >= next_young:
                next_young = now + self.young_interval_s
                gc.collect(1)
            if now >= next_trim and self._trim is not None:
                next_trim = now + self.trim_interval_s
                await loop.run_in_executor(None, self._trim, 0)

    def _observe(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._by_generation[min(int(info["generation"]), 2)].observe(
                time.perf_counter() - self._started)
