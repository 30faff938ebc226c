"""Persistence: what the report and hello paths write, seen through another store (the
minute rollups: test_rate_series.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import pytest
from prometheus_client import CollectorRegistry

from gearshift.controller.decisions.store import DecisionStore
from gearshift.controller.ingest.fleet import FleetState, HostEntry
from gearshift.controller.store.database import Store
from gearshift.controller.store.persistence import Persistence
from gearshift.controller.store.writer import BatchingWriter
from gearshift.v1 import agent_pb2

T0 = datetime(2026, 3, 2, 12, 0, tzinfo=UTC).timestamp()
READY = agent_pb2.DEPLOYMENT_PHASE_READY
DRAINING = agent_pb2.DEPLOYMENT_PHASE_DRAINING


@pytest.fixture
def persistence(open_store: Callable[[], Store]) -> Iterator[Persistence]:
    store = open_store()
    p = Persistence(store, BatchingWriter(store, flush_interval_s=3600,
                                          registry=CollectorRegistry()))
    yield p
    p.writer.close()


def _connect(fleet: FleetState, host: str) -> HostEntry:
    hello = agent_pb2.Hello(host_id=host, agent_version="1.2", labels={"zone": "z1"},
                            protocol_version=agent_pb2.PROTOCOL_VERSION_1)
    hello.gpus.add(index=0, uuid="GPU-0", model="NVIDIA H100", memory_total_bytes=80 << 30)
    hello.engines.add(engine="vllm", version="0.40.0", executable="vllm", release="0.18",
                      version_match=agent_pb2.VERSION_MATCH_NEAREST, version_source="metadata")
    hello.engines.add(engine="sglang", executable="sglang")  # an agent before version tables
    return fleet.hello(hello, 10.0)


def _report(seq: int, *deps: tuple[str, str, str, int]) -> agent_pb2.Report:
    r = agent_pb2.Report(seq=seq)
    for dep_id, model, revision, phase in deps:
        r.deployments.add(deployment_id=dep_id, model=model, revision=revision, phase=phase,
                          engine="vllm", engine_version="0.11.0", endpoint="http://h:8000",
                          metrics_present=True, request_rate=2.0)
    return r


def test_hello_writes_the_host(persistence: Persistence, open_store: Callable[[], Store]) -> None:
    fleet = FleetState(clock=lambda: T0)
    persistence.host_seen(_connect(fleet, "h1"))
    assert persistence.writer.flush() is True
    host = open_store().get_host("h1")
    assert host is not None
    assert (host.agent_version, host.labels, host.last_seen.timestamp()) == ("1.2", {"zone": "z1"}, T0)
    assert host.gpus == [{"index": 0, "uuid": "GPU-0", "model": "NVIDIA H100",
                          "memory_total_bytes": 80 << 30}]
    assert host.engines == [
        {"engine": "vllm", "version": "0.40.0", "executable": "vllm", "release": "0.18",
         "version_match": "nearest", "version_source": "metadata"},
        {"engine": "sglang", "version": "", "executable": "sglang", "release": "",
         "version_match": "", "version_source": ""}]


def test_deployments_and_revisions_are_written_when_they_change_only(
        persistence: Persistence, open_store: Callable[[], Store]) -> None:
    fleet = FleetState(clock=lambda: T0)
    _connect(fleet, "h1")
    other = open_store()
    persistence.report("h1", _report(1, ("d1", "llama", "r1", READY),
                                     ("d2", "qwen", "", READY)), T0)
    assert persistence.writer.flush() is True
    assert [(d.deployment_id, d.phase, d.revision, d.updated.timestamp())
            for d in other.list_deployments()] == [("d1", "ready", "r1", T0), ("d2", "ready", "", T0)]
    assert [r.revision for r in DecisionStore(other.engine).list_revisions("llama")] == ["r1"]

    persistence.report("h1", _report(2, ("d1", "llama", "r1", READY),
                                     ("d2", "qwen", "", READY)), T0 + 10)
    assert persistence.writer.pending == 0  # nothing that is stored changed

    persistence.report("h1", _report(3, ("d1", "llama", "r2", DRAINING),
                                     ("d2", "qwen", "", READY)), T0 + 20)
    assert persistence.writer.pending == 2  # d1's row and its new revision
    assert persistence.writer.flush() is True
    d1 = next(d for d in other.list_deployments() if d.deployment_id == "d1")
    assert (d1.phase, d1.revision, d1.updated.timestamp()) == ("draining", "r2", T0 + 20)
    assert [(r.revision, r.source) for r in DecisionStore(other.engine).list_revisions("llama")] == [
        ("r1", "agent"), ("r2", "agent")]


def test_gone_hosts_are_forgotten_in_memory_and_in_the_store(
        persistence: Persistence, open_store: Callable[[], Store]) -> None:
    now = [T0]
    fleet = FleetState(clock=lambda: now[0])
    for host in ("fake", "real", "live"):
        persistence.host_seen(_connect(fleet, host))
    fleet.report("real", _report(1, ("d1", "m", "r1", READY)))
    fleet.report("live", _report(1, ("d2", "m", "r1", READY)))
    persistence.save_hosts(fleet)
    persistence.writer.flush()
    fleet.disconnected("fake", fleet.hosts["fake"])
    fleet.disconnected("real", fleet.hosts["real"])
    now[0] = T0 + 601  # a hello and no report: gone after ten minutes
    assert persistence.prune_hosts(fleet, now[0]) == ["fake"]
    assert "fake" not in fleet.hosts and open_store().get_host("fake") is None
    assert persistence.prune_hosts(fleet, now[0] + 6 * 86400) == []
    now[0] = T0 + 8 * 86400  # reported once, gone a week: forgotten with its deployments
    assert persistence.prune_hosts(fleet, now[0]) == ["real"]
    assert set(fleet.hosts) == {"live"}  # connected hosts are never pruned
    assert [h for _h, d, _ts in fleet.deployments() for h in [d.deployment_id]] == ["d2"]
    assert [h.host_id for h in open_store().list_hosts()] == ["live"]
    assert [e.deployment_id for m in fleet.routing_table().models for e in m.endpoints] == ["d2"]


def test_an_unknown_phase_is_stored_as_unknown(persistence: Persistence,
                                               open_store: Callable[[], Store]) -> None:
    fleet = FleetState(clock=lambda: T0)
    _connect(fleet, "h1")
    report = _report(1, ("d1", "m", "r1", 42))  # a phase a newer agent knows
    fleet.report("h1", report)
    persistence.report("h1", report, T0)
    persistence.save_hosts(fleet)
    assert persistence.writer.flush() is True
    [row] = open_store().list_deployments()
    assert row.phase == "unknown"
