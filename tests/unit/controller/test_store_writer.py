"""BatchingWriter: durability on flush/close, retry after a failed commit, bounded queue."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from gearshift.controller.decisions.store import DecisionStore
from gearshift.controller.store.database import Store
from gearshift.controller.store.tables import CommandLogRow, DeploymentRow, HostRow, RollupRow
from gearshift.controller.store.writer import BatchingWriter

T0 = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
WAIT_LIMIT_S = 30.0  # generous bound for polling loops (never asserted as a duration)


def _metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def _wait_until(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_LIMIT_S
    while not cond():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.01)


def _rollup(minute: int, **overrides) -> RollupRow:  # type: ignore[no-untyped-def]
    fields = dict(model="llama", engine="vllm", minute=T0 + timedelta(minutes=minute),
                  reports=1, replicas=1)
    fields.update(overrides)
    return RollupRow(**fields)


def _rename(store_url: str, old: str, new: str) -> None:
    engine = sa.create_engine(store_url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"ALTER TABLE {old} RENAME TO {new}")
    finally:
        engine.dispose()


def test_flush_makes_every_kind_durable_for_another_store(open_store) -> None:  # type: ignore[no-untyped-def]
    writer = BatchingWriter(open_store(), flush_interval_s=3600, registry=CollectorRegistry())
    try:
        writer.submit_host(HostRow(host_id="h1", agent_version="1"))
        writer.submit_host(HostRow(host_id="h1", agent_version="2"))  # coalesced, last wins
        writer.submit_deployment(DeploymentRow(deployment_id="d1", host_id="h1", model="llama",
                                               engine="vllm"))
        writer.submit_deployment(DeploymentRow(deployment_id="d2", host_id="h1", model="llama",
                                               engine="vllm"))
        writer.submit_deployment_removal("d2")
        assert writer.submit_rollups([_rollup(0), _rollup(1)]) == 2
        writer.submit_command(CommandLogRow(command_id="c1", host_id="h1", epoch=1, kind="start"))
        assert writer.pending == 6
        assert writer.flush() is True
        assert writer.pending == 0
        other = open_store()
        assert [(h.host_id, h.agent_version) for h in other.list_hosts()] == [("h1", "2")]
        assert [d.deployment_id for d in other.list_deployments()] == ["d1"]
        assert len(other.rollups(model="llama")) == 2
        cmd = other.get_command("c1")
        assert cmd is not None and cmd.phase == "pending"
        writer.submit_command(CommandLogRow(command_id="c1", host_id="h1", epoch=1, kind="start",
                                            phase="succeeded", message="ok"))
        writer.submit_deployment_removal("d1")
        assert writer.flush() is True
        cmd = other.get_command("c1")
        assert cmd is not None and (cmd.phase, cmd.message) == ("succeeded", "ok")
        assert other.list_deployments() == []
    finally:
        writer.close()


def test_close_flushes_and_later_submits_are_dropped(open_store) -> None:  # type: ignore[no-untyped-def]
    registry = CollectorRegistry()
    writer = BatchingWriter(open_store(), flush_interval_s=3600, registry=registry)
    writer.submit_rollups([_rollup(i) for i in range(50)])
    assert writer.close() is True
    assert len(open_store().rollups()) == 50
    assert writer.submit_host(HostRow(host_id="late")) is False
    assert _metric(registry, "gearshift_store_writes_dropped_total", kind="host",
                   reason="closed") == 1
    assert writer.flush() is True  # nothing accepted is outstanding


def test_max_batch_triggers_a_commit_without_flush(open_store) -> None:  # type: ignore[no-untyped-def]
    registry = CollectorRegistry()
    writer = BatchingWriter(open_store(), flush_interval_s=3600, max_batch=10, registry=registry)
    other = open_store()
    try:
        writer.submit_rollups([_rollup(i) for i in range(10)])
        _wait_until(lambda: len(other.rollups()) == 10)
        # the commit is visible before its duration is observed: wait for both
        _wait_until(lambda: _metric(registry, "gearshift_store_flush_seconds_count") >= 1)
    finally:
        writer.close()


def test_failed_commit_is_counted_and_retried_without_losing_rows(
        open_store, store_url: str) -> None:  # type: ignore[no-untyped-def]
    registry = CollectorRegistry()
    writer = BatchingWriter(open_store(), flush_interval_s=0.02, registry=registry)
    other = open_store()
    try:
        _rename(store_url, "rollups", "rollups_away")  # every commit now fails
        writer.submit_host(HostRow(host_id="h1", agent_version="old"))
        writer.submit_rollups([_rollup(0, reports=1)])
        _wait_until(lambda: _metric(registry, "gearshift_store_write_errors_total") >= 2)
        assert writer.flush(timeout_s=0.05) is False
        # rows submitted while failing win over the retried ones of the same key
        writer.submit_host(HostRow(host_id="h1", agent_version="new"))
        writer.submit_rollups([_rollup(1)])
        assert other.list_hosts() == []  # the failed transaction committed nothing
        _rename(store_url, "rollups_away", "rollups")
        assert writer.flush(timeout_s=WAIT_LIMIT_S) is True
        assert [h.agent_version for h in other.list_hosts()] == ["new"]
        assert [r.minute for r in other.rollups()] == [T0, T0 + timedelta(minutes=1)]
    finally:
        writer.close()


def test_full_pending_set_drops_new_keys_and_counts_them(open_store) -> None:  # type: ignore[no-untyped-def]
    registry = CollectorRegistry()
    writer = BatchingWriter(open_store(), flush_interval_s=3600, max_batch=100, max_pending=2,
                            registry=registry)
    try:
        assert writer.submit_host(HostRow(host_id="h1")) is True
        assert writer.submit_host(HostRow(host_id="h2")) is True
        assert writer.submit_host(HostRow(host_id="h3")) is False
        assert writer.submit_host(HostRow(host_id="h1", agent_version="2")) is True  # update
        assert _metric(registry, "gearshift_store_writes_dropped_total", kind="host",
                       reason="full") == 1
        assert _metric(registry, "gearshift_store_pending_writes") == 2
        assert writer.flush() is True
        assert [h.host_id for h in open_store().list_hosts()] == ["h1", "h2"]
    finally:
        writer.close()


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")
def test_a_row_the_database_refuses_is_dropped_alone(open_store) -> None:  # type: ignore[no-untyped-def]
    registry = CollectorRegistry()
    writer = BatchingWriter(open_store(), flush_interval_s=3600, registry=registry)
    try:
        writer.submit_host(HostRow(host_id="good"))
        writer.submit_host(HostRow(host_id="bad", labels={"zone": object()}))  # not JSON
        writer.submit_rollups([_rollup(0)])
        assert writer.flush(timeout_s=WAIT_LIMIT_S) is True
        other = open_store()
        assert [h.host_id for h in other.list_hosts()] == ["good"]
        assert len(other.rollups()) == 1
        assert _metric(registry, "gearshift_store_writes_dropped_total", kind="host",
                       reason="rejected") == 1
        assert _metric(registry, "gearshift_store_write_errors_total") == 1
    finally:
        writer.close()


def test_submits_from_many_threads_all_land(open_store) -> None:  # type: ignore[no-untyped-def]
    writer = BatchingWriter(open_store(), flush_interval_s=0.01, max_batch=7,
                            registry=CollectorRegistry())

    def work(t: int) -> None:
        for i in range(25):
            writer.submit_deployment(DeploymentRow(deployment_id=f"d{t}-{i}", host_id=f"h{t}",
                                                   model="llama", engine="vllm"))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert writer.close() is True
    assert len(open_store().list_deployments()) == 100


def test_bad_settings_are_refused(store: Store) -> None:
    with pytest.raises(ValueError, match="flush_interval_s > 0"):
        BatchingWriter(store, flush_interval_s=0)


def test_dict_rows_land_with_their_defaults(open_store) -> None:  # type: ignore[no-untyped-def]
    writer = BatchingWriter(open_store(), flush_interval_s=3600, registry=CollectorRegistry())
    try:
        assert writer.submit_host({"host_id": "h1", "labels": {"zone": "a"}, "last_seen": T0})
        assert writer.submit_deployments([
            {"deployment_id": f"d{i}", "host_id": "h1", "model": "llama", "engine": "vllm",
             "phase": "ready"} for i in range(3)]) == 3
        assert writer.submit_rollups([{"model": "llama", "engine": "vllm", "minute": T0,
                                       "reports": 2, "ttft_p99_s": 0.5}]) == 1
        assert writer.submit_command({"command_id": "c1", "host_id": "h1", "epoch": 3,
                                      "kind": "start", "payload": {"model": "llama"}})
        assert writer.flush() is True
        other = open_store()
        host = other.get_host("h1")
        assert host is not None and host.labels == {"zone": "a"} and host.last_seen == T0
        assert host.gpus == [] and host.agent_version == "" and host.first_seen is not None
        assert [(d.deployment_id, d.phase) for d in other.list_deployments()] == [
            ("d0", "ready"), ("d1", "ready"), ("d2", "ready")]
        (rollup,) = other.rollups()
        assert (rollup.reports, rollup.ttft_p99_s, rollup.itl_p99_s) == (2, 0.5, None)
        cmd = other.get_command("c1")
        assert cmd is not None and (cmd.epoch, cmd.payload, cmd.phase) == (
            3, {"model": "llama"}, "pending")
    finally:
        writer.close()


def test_a_dict_row_with_wrong_columns_is_refused_at_once(store: Store) -> None:
    writer = BatchingWriter(store, flush_interval_s=3600, registry=CollectorRegistry())
    try:
        with pytest.raises(ValueError, match=r"deployment row .*unknown columns \['modle'\], "
                                             r"missing columns \['model'\]"):
            writer.submit_deployment({"deployment_id": "d1", "host_id": "h1", "modle": "llama",
                                      "engine": "vllm"})
        assert writer.pending == 0
    finally:
        writer.close()


def test_a_revision_is_stored_once_and_keeps_its_first_time(open_store) -> None:  # type: ignore[no-untyped-def]
    writer = BatchingWriter(open_store(), flush_interval_s=3600, registry=CollectorRegistry())
    other = DecisionStore(open_store().engine)
    try:
        assert writer.submit_revision("llama", "r1", T0, "agent")
        assert writer.submit_revision("llama", "r2", T0 + timedelta(minutes=1), "agent")
        assert writer.flush() is True
        assert writer.submit_revision("llama", "r1", T0 + timedelta(hours=1), "agent")
        assert writer.flush() is True
        assert other.add_revision("llama", "r2") is False  # the writer stored it already
        assert [(r.revision, r.published_at, r.source) for r in other.list_revisions("llama")] == [
            ("r1", T0, "agent"), ("r2", T0 + timedelta(minutes=1), "agent")]
    finally:
        writer.close()
