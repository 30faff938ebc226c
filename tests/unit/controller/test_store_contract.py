"""Store contract: every public method of `Store` and of its `DecisionStore`, the same on
SQLite and PostgreSQL."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta, timezone

import pytest

from gearshift.common.errors import AlreadyExists, InvalidArgument, NotFound
from gearshift.controller.decisions.store import DecisionStore
from gearshift.controller.store.database import Store
from gearshift.controller.store.tables import (
    SETTING_ACTIVE_POLICY_VERSION,
    SETTING_EPOCH,
    SETTING_PAUSED,
    DecisionRow,
    DeploymentRow,
    HostRow,
    RollupRow,
)
from gearshift.policies.core import DecisionStatus

T0 = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)


def host(**overrides) -> HostRow:  # type: ignore[no-untyped-def]
    fields = dict(host_id="h1", labels={"zone": "a"}, agent_version="0.1.0",
                  gpus=[{"index": 0, "uuid": "GPU-1", "model": "NVIDIA H100",
                         "memory_total_bytes": 85899345920}],
                  engines=[{"engine": "vllm", "version": "0.10.1", "executable": "vllm"}],
                  first_seen=T0, last_seen=T0)
    fields.update(overrides)
    return HostRow(**fields)


def deployment(**overrides) -> DeploymentRow:  # type: ignore[no-untyped-def]
    fields = dict(deployment_id="d1", host_id="h1", model="llama", engine="vllm",
                  engine_version="0.10.1", revision="r1", phase="ready",
                  endpoint="http://127.0.0.1:8000", updated=T0)
    fields.update(overrides)
    return DeploymentRow(**fields)


def rollup(**overrides) -> RollupRow:  # type: ignore[no-untyped-def]
    fields = dict(model="llama", engine="vllm", minute=T0, engine_version="0.10.1",
                  gpu_model="NVIDIA H100", reports=12, replicas=2, request_rate_mean=10.5,
                  request_rate_max=12.0, running_mean=4.0, waiting_mean=0.5,
                  ttft_p50_s=0.1, ttft_p99_s=0.4, itl_p50_s=0.02, itl_p99_s=0.05,
                  e2e_p99_s=3.0, generation_tokens_per_s=900.0, kv_cache_usage_mean=0.3,
                  errors=2)
    fields.update(overrides)
    return RollupRow(**fields)


def decision(**overrides) -> DecisionRow:  # type: ignore[no-untyped-def]
    fields = dict(model="llama", from_engine="vllm", to_engine="tensorrt-llm",
                  rule="sustained-traffic", inputs={"sustained_rps": 42.0},
                  expected={"cost_usd_per_day": -120.5, "ttft_p99_s": -0.05},
                  alternatives=[{"engine": "vllm", "why": "costs more"}],
                  policy_version=1, mode="approve", created_at=T0)
    fields.update(overrides)
    return DecisionRow(**fields)


@pytest.fixture
def decisions(store: Store) -> DecisionStore:
    """The decision queries, on the contract's store (SQLite or PostgreSQL)."""
    return DecisionStore(store.engine)


def test_dialect_matches_backend(store: Store, store_url: str) -> None:
    assert store.dialect == ("sqlite" if store_url.startswith("sqlite") else "postgresql")


def test_hosts_upsert_keeps_first_seen_and_replaces_the_rest(store: Store) -> None:
    store.upsert_hosts([host(), host(host_id="h2", labels={})])
    later = T0 + timedelta(minutes=5)
    store.upsert_hosts([host(first_seen=later, last_seen=later, agent_version="0.2.0",
                             last_report_seq=7)])
    hosts = store.list_hosts()
    assert [h.host_id for h in hosts] == ["h1", "h2"]
    h1 = hosts[0]
    assert h1.first_seen == T0 and h1.last_seen == later
    assert h1.agent_version == "0.2.0" and h1.last_report_seq == 7
    assert h1.gpus[0]["memory_total_bytes"] == 85899345920
    assert h1.labels == {"zone": "a"}
    assert hosts[1].last_report_seq is None
    assert store.get_host("h2") is not None and store.get_host("nope") is None


def test_hosts_seen_before_a_cutoff_oldest_first_with_whether_they_reported(
        store: Store) -> None:
    store.upsert_hosts([host(host_id="new", last_seen=T0 + timedelta(minutes=10)),
                        host(host_id="old", last_seen=T0, last_report_seq=3),
                        host(host_id="older", last_seen=T0 - timedelta(hours=1)),
                        host(host_id="edge", last_seen=T0 + timedelta(minutes=5))])
    cutoff = (T0 + timedelta(minutes=5)).astimezone(timezone(timedelta(hours=2)))
    assert store.hosts_seen_before(cutoff) == [
        ("older", T0 - timedelta(hours=1), False), ("old", T0, True),
        ("edge", T0 + timedelta(minutes=5), False)]  # at the cutoff counts
    assert store.hosts_seen_before(T0 - timedelta(days=1)) == []


def test_deployments_upsert_filter_delete(store: Store) -> None:
    store.upsert_deployments([deployment(), deployment(deployment_id="d2", host_id="h2"),
                              deployment(deployment_id="d3", model="qwen")])
    store.upsert_deployments([deployment(phase="draining")])
    assert [d.deployment_id for d in store.list_deployments()] == ["d1", "d2", "d3"]
    assert [d.deployment_id for d in store.list_deployments(model="llama")] == ["d1", "d2"]
    assert [d.deployment_id for d in store.list_deployments(host_id="h2")] == ["d2"]
    assert [d.deployment_id for d in store.list_deployments(model="llama", host_id="h1")] == ["d1"]
    assert store.list_deployments(model="llama")[0].phase == "draining"
    assert store.delete_deployment("d1") is True
    assert store.delete_deployment("d1") is False
    assert [d.deployment_id for d in store.list_deployments()] == ["d2", "d3"]


def test_rollups_upsert_on_model_engine_minute_and_range(store: Store) -> None:
    minutes = [T0 + timedelta(minutes=i) for i in range(3)]
    store.write_rollups([rollup(minute=m) for m in minutes]
                        + [rollup(engine="tensorrt-llm"), rollup(model="qwen")])
    store.write_rollups([rollup(minute=minutes[1], reports=99, ttft_p99_s=None)])
    got = store.rollups(model="llama", engine="vllm")
    assert [r.minute for r in got] == minutes
    assert got[1].reports == 99 and got[1].ttft_p99_s is None
    assert got[0].ttft_p99_s == pytest.approx(0.4) and got[0].errors == 2
    assert got[0].minute.tzinfo is not None
    ranged = store.rollups(model="llama", engine="vllm", since=minutes[1], until=minutes[2])
    assert [r.minute for r in ranged] == [minutes[1]]
    assert {(r.model, r.engine) for r in store.rollups(since=T0, until=minutes[1])} == {
        ("llama", "vllm"), ("llama", "tensorrt-llm"), ("qwen", "vllm")}
    assert len(store.rollups()) == 5


def test_rollup_range_compares_instants_across_timezones(store: Store) -> None:
    store.write_rollups([rollup()])
    plus2 = timezone(timedelta(hours=2))
    assert len(store.rollups(since=T0.astimezone(plus2))) == 1
    assert store.rollups(since=(T0 + timedelta(seconds=1)).astimezone(plus2)) == []


def test_command_log(store: Store) -> None:
    row = store.log_command("c1", "h1", 3, "start", {"spec": {"model": "llama"}})
    assert row.phase == "pending" and row.payload == {"spec": {"model": "llama"}}
    again = store.log_command("c1", "h9", 4, "stop", {})
    assert (again.host_id, again.epoch, again.kind) == ("h1", 3, "start")
    assert store.update_command("c1", "succeeded", "started on port 8000") is True
    assert store.update_command("missing", "failed") is False
    got = store.get_command("c1")
    assert got is not None and got.phase == "succeeded" and got.message == "started on port 8000"
    assert got.updated >= got.created
    store.log_command("c2", "h2", 3, "drain", {"deployment_id": "d1"})
    assert {c.command_id for c in store.list_commands()} == {"c1", "c2"}
    assert [c.command_id for c in store.list_commands(host_id="h2")] == ["c2"]
    assert store.get_command("missing") is None


def test_policy_versions_grow_and_carry_digest(decisions: DecisionStore) -> None:
    v1 = decisions.add_policy_version("default", "rules: []\n", "alice", "first")
    v2 = decisions.add_policy_version("default", "rules: [x]\n", "bob")
    assert v2 > v1 >= 1
    got = decisions.get_policy_version(v1)
    assert got is not None and got.yaml_text == "rules: []\n" and got.applied_by == "alice"
    assert got.comment == "first"
    assert got.digest == hashlib.sha256(b"rules: []\n").hexdigest()
    assert [p.version for p in decisions.list_policy_versions()] == [v2, v1]
    assert decisions.get_policy_version(999) is None


def test_settings_json_values_and_types(store: Store) -> None:
    assert store.get_setting(SETTING_PAUSED, False) is False
    store.set_setting(SETTING_PAUSED, True)
    store.set_setting(SETTING_ACTIVE_POLICY_VERSION, 3)
    store.set_setting("ui", {"theme": "dark", "cols": [1, 2]})
    assert store.get_setting(SETTING_PAUSED) is True
    assert store.get_setting(SETTING_ACTIVE_POLICY_VERSION) == 3
    assert store.get_setting("ui") == {"theme": "dark", "cols": [1, 2]}
    store.set_setting(SETTING_ACTIVE_POLICY_VERSION, None)
    assert store.get_setting(SETTING_ACTIVE_POLICY_VERSION, 7) is None
    with pytest.raises(InvalidArgument, match="'paused' must be bool"):
        store.set_setting(SETTING_PAUSED, "yes")
    with pytest.raises(InvalidArgument, match="'epoch' must be int"):
        store.set_setting(SETTING_EPOCH, True)
    with pytest.raises(InvalidArgument, match=r"'blob'.*not JSON serializable"):
        store.set_setting("blob", object())
    assert store.get_setting(SETTING_PAUSED) is True


def test_bump_epoch_counts_up(store: Store, open_store) -> None:  # type: ignore[no-untyped-def]
    assert store.bump_epoch() == 1
    assert store.bump_epoch() == 2
    assert open_store().bump_epoch() == 3
    assert store.get_setting(SETTING_EPOCH) == 3


def test_decisions_round_trip_and_list(decisions: DecisionStore) -> None:
    d1 = decisions.add_decision(decision())
    d2 = decisions.add_decision(decision(created_at=T0 + timedelta(minutes=1), model="qwen"))
    d3 = decisions.add_decision(decision(created_at=T0 + timedelta(minutes=2),
                                     status=DecisionStatus.REJECTED))
    got = decisions.get_decision(d1)
    assert got is not None
    assert got.status is DecisionStatus.PROPOSED and got.created_at == T0
    assert got.inputs == {"sustained_rps": 42.0}
    assert got.expected["cost_usd_per_day"] == pytest.approx(-120.5)
    assert got.alternatives == [{"engine": "vllm", "why": "costs more"}]
    assert [d.id for d in decisions.list_decisions()] == [d3, d2, d1]
    assert [d.id for d in decisions.list_decisions(model="llama")] == [d3, d1]
    assert [d.id for d in decisions.list_decisions(status=DecisionStatus.PROPOSED)] == [d2, d1]
    assert [d.id for d in decisions.list_decisions(limit=1)] == [d3]
    assert decisions.get_decision("d-missing") is None
    with pytest.raises(AlreadyExists, match=d1):
        decisions.add_decision(decision(id=d1))
    with pytest.raises(InvalidArgument, match="unknown decision status 'nope'"):
        decisions.list_decisions(status="nope")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="limit must be a positive integer, got 0"):
        decisions.list_decisions(limit=0)


def test_decision_status_compare_and_set(decisions: DecisionStore) -> None:
    did = decisions.add_decision(decision())
    assert decisions.update_decision_status(did, DecisionStatus.APPROVED, "alice approved",
                                        expected_from=DecisionStatus.PROPOSED) is True
    # a second approver loses the race: the status is no longer "proposed"
    assert decisions.update_decision_status(did, DecisionStatus.REJECTED, "bob rejected",
                                        expected_from=DecisionStatus.PROPOSED) is False
    got = decisions.get_decision(did)
    assert got is not None
    assert got.status is DecisionStatus.APPROVED and got.status_reason == "alice approved"
    assert decisions.update_decision_status(did, DecisionStatus.EXECUTING) is True
    assert decisions.get_decision(did).status is DecisionStatus.EXECUTING  # type: ignore[union-attr]
    with pytest.raises(NotFound, match="d-nope"):
        decisions.update_decision_status("d-nope", DecisionStatus.DONE)
    with pytest.raises(InvalidArgument, match="unknown decision status 'finished'"):
        decisions.update_decision_status(did, "finished")  # type: ignore[arg-type]


def test_revisions_unique_and_since(decisions: DecisionStore) -> None:
    assert decisions.add_revision("llama", "r1", T0, "agent") is True
    assert decisions.add_revision("llama", "r1", T0 + timedelta(days=1), "cli") is False
    assert decisions.add_revision("llama", "r2", T0 + timedelta(days=3)) is True
    assert decisions.add_revision("qwen", "r1", T0) is True
    assert [r.revision for r in decisions.list_revisions("llama")] == ["r1", "r2"]
    assert [r.revision for r in decisions.list_revisions("llama", since=T0 + timedelta(days=1))] == [
        "r2"]
    first = decisions.list_revisions("llama")[0]
    assert first.published_at == T0 and first.source == "agent"


def test_revision_timestamps_are_the_published_times_to_the_bit_oldest_first(decisions: DecisionStore) -> None:
    later = (T0 + timedelta(days=2, microseconds=123_457)).astimezone(timezone(timedelta(hours=-7)))
    decisions.add_revision("llama", "r2", later)
    decisions.add_revision("llama", "r1", T0 + timedelta(microseconds=999_999))
    decisions.add_revision("qwen", "r1", T0)
    got = decisions.revision_timestamps()
    assert got == {m: [r.published_at.timestamp() for r in decisions.list_revisions(m)]
                   for m in ("llama", "qwen")}
    assert got["llama"] == [(T0 + timedelta(microseconds=999_999)).timestamp(), later.timestamp()]


def test_tenure_timestamps_are_the_tenures_since_to_the_bit(decisions: DecisionStore) -> None:
    assert decisions.tenure_timestamps() == {}
    odd = (T0 + timedelta(days=2, microseconds=123_457)).astimezone(timezone(timedelta(hours=-7)))
    decisions.set_tenures({"llama": ("vllm", odd),
                       "qwen": ("tensorrt-llm", T0 + timedelta(microseconds=999_999))})
    got = decisions.tenure_timestamps()
    assert got == {m: (e, since.timestamp()) for m, (e, since) in decisions.tenures().items()}
    assert got["llama"] == ("vllm", odd.timestamp())


def test_tenures_round_trip_replace_and_read_back_utc(decisions: DecisionStore) -> None:
    assert decisions.tenures() == {}
    decisions.set_tenures({"llama": ("vllm", T0), "qwen": ("tensorrt-llm", T0 + timedelta(hours=1))})
    decisions.set_tenure("llama", "tensorrt-llm", T0 + timedelta(days=2))
    got = decisions.tenures()
    assert got == {"llama": ("tensorrt-llm", T0 + timedelta(days=2)),
                   "qwen": ("tensorrt-llm", T0 + timedelta(hours=1))}
    assert all(since.tzinfo is not None and since.utcoffset() == timedelta(0)
               for _, since in got.values())
    assert decisions.get_tenure("qwen") is not None
