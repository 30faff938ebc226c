"""How late the controller's event loop runs what is due: its stalls, as a metric.

Every agent's ack, every route push and every housekeeping step runs on one
asyncio loop, so anything that holds it (a walk over the fleet, a garbage
collection, a thread holding the GIL) delays every ack by as long. `LoopLagProbe`
sleeps `PROBE_INTERVAL_S` at a time and observes how much later than asked it
woke up in ``gearshift_controller_event_loop_lag_seconds``: a wake-up that came
100 ms late means the loop was held about that long. The probe costs one timer
every `PROBE_INTERVAL_S` (well under a thousandth of a core).
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Histogram

PROBE_INTERVAL_S = 0.05
LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LoopLagProbe:
    """Observes the event loop's lateness; `run()` is a task on the loop it measures."""

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 interval_s: float = PROBE_INTERVAL_S) -> None:
        if interval_s <= 0:
            raise ValueError(f"LoopLagProbe: interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.lag_seconds = Histogram(
            "gearshift_controller_event_loop_lag_seconds",
            "How late the controller's event loop woke a timer, in seconds: the loop was "
            "held (by work, a garbage collection or another thread) about that long.",
            buckets=LAG_BUCKETS_S, registry=registry or CollectorRegistry())

    async def run(self) -> None:
        """Probe until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.lag_seconds.observe(max(0.0, loop.time() - due))
