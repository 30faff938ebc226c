"""LoopLagProbe: a loop held by blocking work shows in the lag histogram; an idle one does not."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from gearshift.controller.loop_lag import LoopLagProbe

WAIT_LIMIT_S = 30.0  # generous bound for waiting on the loop (never asserted as a duration)
HOLD_S = 0.3  # how long the test holds the loop


def _probes(registry: CollectorRegistry, le: str = "+Inf") -> float:
    return registry.get_sample_value("gearshift_controller_event_loop_lag_seconds_bucket",
                                     {"le": le}) or 0.0


async def _probed(registry: CollectorRegistry, n: int) -> None:
    async with asyncio.timeout(WAIT_LIMIT_S):
        while _probes(registry) < n:
            await asyncio.sleep(0.005)


async def test_a_held_loop_is_observed_as_late_by_about_as_long() -> None:
    registry = CollectorRegistry()
    task = asyncio.create_task(LoopLagProbe(registry, interval_s=0.01).run())
    try:
        await _probed(registry, 2)
        over_before = _probes(registry) - _probes(registry, "0.25")
        time.sleep(HOLD_S)  # blocks the loop, as a walk over a large fleet would
        await _probed(registry, _probes(registry) + 2)
        # The wake-up due during the hold came at least HOLD_S - interval late (over 0.25 s).
        assert _probes(registry) - _probes(registry, "0.25") >= over_before + 1
    finally:
        task.cancel()


def test_bad_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="interval_s must be > 0, got 0"):
        LoopLagProbe(interval_s=0)
