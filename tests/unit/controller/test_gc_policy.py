"""GcPolicy: settings applied and restored, pauses observed, scheduled young and full
collections."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from gearshift.controller.gc_policy import NO_AUTOMATIC_FULL, GcPolicy

WAIT_LIMIT_S = 30.0  # generous bound for waiting on the loop (never asserted as a duration)


def _pauses(registry: CollectorRegistry, generation: int) -> float:
    return registry.get_sample_value("gearshift_controller_gc_pause_seconds_count",
                                     {"generation": str(generation)}) or 0.0


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    before = gc.get_threshold()
    yield CollectorRegistry()
    assert gc.get_threshold() == before  # every test leaves the process as it found it


def test_install_freezes_and_stops_automatic_full_collections(registry: CollectorRegistry) -> None:
    before = gc.get_threshold()
    policy = GcPolicy(registry)
    policy.install()
    try:
        assert gc.get_threshold() == (before[0], before[1], NO_AUTOMATIC_FULL)
        assert gc.get_freeze_count() > 0
        gc.collect(0)
        assert _pauses(registry, 0) >= 1
    finally:
        policy.uninstall()
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    seen = _pauses(registry, 0)
    gc.collect(0)
    assert _pauses(registry, 0) == seen  # no longer observed


async def test_run_collects_everything_on_schedule(registry: CollectorRegistry) -> None:
    policy = GcPolicy(registry, full_interval_s=0.01)
    policy.install()
    task = asyncio.create_task(policy.run())
    try:
        async with asyncio.timeout(WAIT_LIMIT_S):
            while _pauses(registry, 2) < 2:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        policy.uninstall()


async def test_run_collects_the_young_generations_on_schedule(
        registry: CollectorRegistry) -> None:
    policy = GcPolicy(registry, young_interval_s=0.01)
    policy.install()
    gc.disable()  # no allocation-driven collections: only the scheduled ones are counted
    task = asyncio.create_task(policy.run())
    try:
        async with asyncio.timeout(WAIT_LIMIT_S):
            while _pauses(registry, 1) < 3:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        gc.enable()
        policy.uninstall()
    assert _pauses(registry, 2) == 0  # the young ones only (the full one is 10 min away)


async def test_run_trims_the_heap_on_schedule(registry: CollectorRegistry) -> None:
    trims: list[int] = []

    def trim(pad: int) -> int:
        trims.append(pad)
        return 1

    policy = GcPolicy(registry, trim_interval_s=0.01, trim=trim)
    task = asyncio.create_task(policy.run())
    try:
        async with asyncio.timeout(WAIT_LIMIT_S):
            while len(trims) < 2:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
    assert trims[:2] == [0, 0] and _pauses(registry, 2) == 0  # trims, no full collections


def test_bad_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="full_interval_s must be > 0, got 0"):
        GcPolicy(full_interval_s=0)
    with pytest.raises(ValueError, match="trim_interval_s must be > 0, got -1"):
        GcPolicy(trim_interval_s=-1)
    with pytest.raises(ValueError, match="young_interval_s must be > 0, got 0"):
        GcPolicy(young_interval_s=0)


def test_uninstall_leaves_another_owners_frozen_objects_frozen(
        registry: CollectorRegistry) -> None:
    gc.collect()
    gc.freeze()  # another owner in the process (a backtest, a second controller) froze first
    theirs = gc.get_freeze_count()
    try:
        assert theirs > 0
        policy = GcPolicy(registry)
        policy.install()
        policy.uninstall()
        assert gc.get_freeze_count() >= theirs  # theirs are not thawed
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
