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
  reclaimed, at a known rate instead of at allocation-driven moments.

The young threshold stays CPython's (700): at 10,000 agents raising it to 7,000 halved
the collector's time (1.6 s to 0.7 s over 40 s) but made each generation-1 collection
25-100 ms instead of a few, each one an ack stall.

Every collection's pause is observed in ``gearshift_controller_gc_pause_seconds``
(by generation). `uninstall()` restores the previous settings (tests run
controllers inside one process).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

log = logging.getLogger(__name__)

FULL_INTERVAL_S = 600.0
# gc.set_threshold's third value: full collections wait for this many young (generation 1)
# collections, which at any realistic rate is never; `run` collects instead.
NO_AUTOMATIC_FULL = 1 << 30


class GcPolicy:
    """Freeze start-up objects, stop automatic full collections, collect on a schedule."""

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 full_interval_s: float = FULL_INTERVAL_S) -> None:
        if full_interval_s <= 0:
            raise ValueError(f"GcPolicy: full_interval_s must be > 0, got {full_interval_s}")
        self.full_interval_s = full_interval_s
        self.pause_seconds = Histogram(
            "gearshift_controller_gc_pause_seconds",
            "Pauses of the Python garbage collector, by generation, in seconds.",
            ["generation"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=registry or CollectorRegistry())
        self._by_generation = [self.pause_seconds.labels(str(g)) for g in range(3)]
        self._started = 0.0
        self._saved: tuple[int, int, int] | None = None

    def install(self) -> None:
        """Apply the settings (call once start-up allocations are done)."""
        if self._saved is not None:
            return
        self._saved = gc.get_threshold()
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
        gc.unfreeze()

    async def run(self) -> None:
        """Full collections every `full_interval_s`, until cancelled."""
        while True:
            await asyncio.sleep(self.full_interval_s)
            started = time.perf_counter()
            found = gc.collect()
            log.debug("full garbage collection: %d objects in %.3f s", found,
                      time.perf_counter() - started)

    def _observe(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._by_generation[min(int(info["generation"]), 2)].observe(
                time.perf_counter() - self._started)
