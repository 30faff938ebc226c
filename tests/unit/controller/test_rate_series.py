"""RateSeries: the one path for a report into a decision. Reports feed the minute rollups,
each completed minute goes to the store, the learner and the SLA gauges at once, and a new
term's series is seeded from the stored minutes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import pytest
from prometheus_client import CollectorRegistry

from gearshift.controller.decisions.learning import CapacityLearner
from gearshift.controller.ingest.fleet import FleetState, HostEntry
from gearshift.controller.ingest.rollup import RollupAggregator
from gearshift.controller.ingest.series import RateSeries
from gearshift.controller.metrics import ControllerMetrics
from gearshift.controller.store.database import Store
from gearshift.controller.store.writer import BatchingWriter
from gearshift.v1 import agent_pb2

T0 = datetime(2026, 3, 2, 12, 0, tzinfo=UTC).timestamp()
READY = agent_pb2.DEPLOYMENT_PHASE_READY


@pytest.fixture
def writer(open_store: Callable[[], Store]) -> Iterator[BatchingWriter]:
    w = BatchingWriter(open_store(), flush_interval_s=3600, registry=CollectorRegistry())
    yield w
    w.close()


def _connect(fleet: FleetState, host: str) -> HostEntry:
    hello = agent_pb2.Hello(host_id=host, agent_version="1.2",
                            protocol_version=agent_pb2.PROTOCOL_VERSION_1)
    hello.gpus.add(index=0, uuid="GPU-0", model="NVIDIA H100", memory_total_bytes=80 << 30)
    return fleet.hello(hello, 10.0)


def _report(seq: int, rate: float) -> agent_pb2.Report:
    r = agent_pb2.Report(seq=seq)
    dep = r.deployments.add(deployment_id="d1", model="llama", phase=READY, engine="vllm",
                            engine_version="0.11.0", endpoint="http://h:8000",
                            metrics_present=True, request_rate=rate, preemptions_per_s=0.5)
    dep.ttft.present, dep.ttft.count, dep.ttft.p50_s, dep.ttft.p99_s = True, 10, 0.1, 0.4
    return r


def _series(store: Store, fleet: FleetState, rollups: RollupAggregator, writer: BatchingWriter,
            now: float) -> tuple[RateSeries, CapacityLearner, ControllerMetrics]:
    learner = CapacityLearner(store)
    metrics = ControllerMetrics(registry=CollectorRegistry())
    series = RateSeries.open(store, fleet, rollups, resolution_s=60.0, now=now, sink=writer,
                             learner=learner, metrics=metrics)
    return series, learner, metrics


async def test_a_completed_minute_goes_to_the_store_the_learner_and_the_gauges(
        open_store: Callable[[], Store], writer: BatchingWriter) -> None:
    fleet = FleetState(clock=lambda: T0)
    entry = _connect(fleet, "h1")
    series, learner, metrics = _series(open_store(), fleet, RollupAggregator(), writer, T0)
    for i in range(3):
        series.report("h1", entry, _report(i + 1, 2.0), T0 + 10 * i)
    assert await series.tick(T0 + 30) == []  # the minute is still open
    (row,) = await series.tick(T0 + 120)
    assert writer.flush() is True
    (stored,) = open_store().rollups(model="llama")
    assert (stored.reports, stored.replicas, stored.request_rate_mean, stored.gpu_model) == (
        3, 1, 2.0, "NVIDIA H100")
    assert stored.minute == row.minute
    assert [m.accepted for m in learner.models.values()] == [1]
    assert metrics.registry.get_sample_value(
        "gearshift_controller_sla_preemptions_per_second",
        {"model": "llama", "engine": "vllm"}) == 0.5


async def test_close_hands_on_the_open_minute(open_store: Callable[[], Store],
                                              writer: BatchingWriter) -> None:
    fleet = FleetState(clock=lambda: T0)
    entry = _connect(fleet, "h1")
    series, learner, _ = _series(open_store(), fleet, RollupAggregator(), writer, T0)
    series.report("h1", entry, _report(1, 3.0), T0 + 5)
    (row,) = series.close()
    assert row.request_rate_mean == 3.0
    assert writer.flush() is True
    assert [r.request_rate_mean for r in open_store().rollups(model="llama")] == [3.0]
    assert [m.accepted for m in learner.models.values()] == [1]


async def test_a_new_terms_series_is_seeded_from_the_stored_minutes_and_samples_live_rates(
        open_store: Callable[[], Store], writer: BatchingWriter) -> None:
    now = [T0]
    fleet = FleetState(clock=lambda: now[0])
    entry = _connect(fleet, "h1")
    rollups = RollupAggregator()  # outlives the term
    first, _, _ = _series(open_store(), fleet, rollups, writer, T0)
    for minute, rate in enumerate((2.0, 4.0)):
        first.report("h1", entry, _report(minute + 1, rate), T0 + 60 * minute + 1)
    await first.tick(T0 + 180)
    assert writer.flush() is True

    now[0] = T0 + 185
    fleet.report("h1", _report(3, 6.0))  # the live rate: the latest report's
    second, _, _ = _series(open_store(), fleet, rollups, writer, now[0])
    ts, rps = second.history.arrays("llama")
    assert (ts.tolist(), rps.tolist()) == ([T0 + 60, T0 + 120], [2.0, 4.0])  # at minutes' ends
    second.sample(now[0])
    ts, rps = second.history.arrays("llama")
    assert (ts.tolist()[-1], rps.tolist()[-1]) == (T0 + 185, 6.0)
