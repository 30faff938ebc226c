"""SLA signals in the controller: refused when hostile, folded into the minute rollups,
exported as Prometheus gauges (absent stays absent)."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gearshift.common.errors import InvalidArgument
from gearshift.controller.api.validation import check_report
from gearshift.controller.ingest.rollup import RollupAggregator
from gearshift.controller.metrics import ControllerMetrics
from gearshift.v1 import agent_pb2

M = datetime(2026, 3, 2, 12, 0, tzinfo=UTC).timestamp()


def rep(dep: str, **overrides: object) -> agent_pb2.DeploymentReport:
    fields: dict[str, object] = dict(
        deployment_id=dep, engine="vllm", model="llama", request_rate=1.0,
        phase=agent_pb2.DEPLOYMENT_PHASE_READY, metrics_present=True)
    fields.update(overrides)
    return agent_pb2.DeploymentReport(**fields)  # type: ignore[arg-type]


def queue(p50: float, p99: float, count: int = 10) -> agent_pb2.Quantiles:
    return agent_pb2.Quantiles(present=True, p50_s=p50, p99_s=p99, mean_s=p50, count=count)


@pytest.mark.parametrize(("fields", "where"), [
    ({"prefix_cache_hit_rate": 1.5}, "prefix_cache_hit_rate"),
    ({"prefix_cache_hit_rate": math.nan}, "prefix_cache_hit_rate"),
    ({"preemptions_per_s": -1.0}, "preemptions_per_s (1 GPU)"),
    ({"preemptions_per_s": 1e9, "tensor_parallel_size": 2}, "preemptions_per_s (2 GPUs)"),
    ({"queue_time": queue(0.1, math.inf)}, "queue_time.p99_s"),
    ({"queue_time": queue(-0.1, 0.2)}, "queue_time.p50_s"),
    ({"mean_prompt_tokens": 1e12}, "mean_prompt_tokens"),
    ({"mean_generation_tokens": -3.0}, "mean_generation_tokens"),
    ({"sleep_state": 9}, "sleep_state"),
    ({"kv_blocks_total": 10, "kv_blocks_used": 11}, "kv_blocks_used"),
    ({"kv_blocks_total": 2**50}, "kv_blocks_total"),
])
def test_hostile_signals_are_refused_naming_the_field(fields: dict[str, object],
                                                      where: str) -> None:
    report = agent_pb2.Report(seq=1, interval_s=1.0)
    report.deployments.append(rep("d1", **fields))
    with pytest.raises(InvalidArgument) as err:
        check_report(report)
    assert f"report.deployments[0].{where}" in str(err.value)


def test_plausible_signals_pass() -> None:
    report = agent_pb2.Report(seq=1, interval_s=1.0)
    report.deployments.append(rep(
        "d1", queue_time=queue(0.1, 0.9), preemptions_per_s=0.5, prefix_cache_hit_rate=1.0,
        sleep_state=agent_pb2.ENGINE_SLEEP_STATE_AWAKE, mean_prompt_tokens=512.0,
        mean_generation_tokens=0.0, kv_blocks_total=2452, kv_blocks_used=2452))
    check_report(report)


def test_minute_rollup_of_the_signals() -> None:
    agg = RollupAggregator()
    agg.add("h1", rep("d1", queue_time=queue(0.1, 0.4, 90), preemptions_per_s=1.0,
                      prefix_cache_hit_rate=0.2, mean_prompt_tokens=100.0,
                      kv_blocks_total=1000, kv_blocks_used=100,
                      sleep_state=agent_pb2.ENGINE_SLEEP_STATE_AWAKE), M + 5)
    agg.add("h1", rep("d1", queue_time=queue(0.3, 0.6, 10), preemptions_per_s=3.0,
                      prefix_cache_hit_rate=0.4, mean_prompt_tokens=300.0,
                      kv_blocks_total=1000, kv_blocks_used=300,
                      sleep_state=agent_pb2.ENGINE_SLEEP_STATE_AWAKE), M + 35)
    # d2 exports none of the optional signals (an engine without them) and is asleep.
    agg.add("h2", rep("d2", sleep_state=agent_pb2.ENGINE_SLEEP_STATE_WEIGHTS_OFFLOADED), M + 40)
    (row,) = agg.flush_completed(M + 120)
    assert row.queue_p50_s == pytest.approx(0.12) and row.queue_p99_s == 0.6
    assert row.preemptions_per_s == pytest.approx(2.0)  # d1's mean; d2 has none
    assert row.prefix_cache_hit_rate == pytest.approx(0.3)
    assert row.mean_prompt_tokens == pytest.approx(200.0) and row.mean_generation_tokens is None
    assert (row.kv_blocks_total, row.kv_blocks_used) == (1000, 300)
    assert row.sleeping_replicas == 1


def test_a_minute_without_the_signals_stores_null() -> None:
    agg = RollupAggregator()
    agg.add("h1", rep("d1"), M + 5)
    (row,) = agg.flush_completed(M + 120)
    assert (row.queue_p99_s, row.preemptions_per_s, row.prefix_cache_hit_rate,
            row.kv_blocks_total) == (None, None, None, None)
    assert row.sleeping_replicas == 0


def test_controller_exports_the_latest_minute_and_drops_absent_signals() -> None:
    metrics = ControllerMetrics(CollectorRegistry())
    agg = RollupAggregator()
    agg.add("h1", rep("d1", queue_time=queue(0.1, 0.9), prefix_cache_hit_rate=0.25,
                      kv_blocks_total=10, kv_blocks_used=4), M + 5)
    agg.add("h1", rep("d1", queue_time=queue(0.2, 2.0)), M + 65)
    metrics.observe_rollups(agg.flush_completed(M + 100))
    text = generate_latest(metrics.registry).decode()
    lbl = 'engine="vllm",model="llama"'
    assert f"gearshift_controller_sla_prefix_cache_hit_ratio{{{lbl}}} 0.25" in text
    assert f'gearshift_controller_sla_kv_blocks{{{lbl},state="used"}} 4.0' in text
    metrics.observe_rollups(agg.flush_completed(M + 200))
    text = generate_latest(metrics.registry).decode()
    assert f'gearshift_controller_sla_queue_time_seconds{{{lbl},quantile="0.99"}} 2.0' in text
    assert f"gearshift_controller_sla_sleeping_replicas{{{lbl}}} 0.0" in text
    # The latest minute had no hit rate and no blocks: no series (absent, not 0).
    assert "gearshift_controller_sla_prefix_cache_hit_ratio{" not in text
    assert "gearshift_controller_sla_kv_blocks{" not in text


def test_live_policy_facts_from_the_ready_deployments() -> None:
    from gearshift.controller.decisions.facts import sla_signals
    ready = [
        ("h1", rep("a", queue_time=queue(0.1, 0.4), preemptions_per_s=1.0,
                   prefix_cache_hit_rate=0.2, kv_blocks_total=100, kv_blocks_used=10,
                   sleep_state=agent_pb2.ENGINE_SLEEP_STATE_AWAKE)),
        ("h2", rep("b", queue_time=queue(0.2, 0.6), preemptions_per_s=2.0,
                   prefix_cache_hit_rate=0.4, kv_blocks_total=100, kv_blocks_used=30,
                   sleep_state=agent_pb2.ENGINE_SLEEP_STATE_DISCARD_ALL)),
        ("h3", rep("c", engine="sglang")),  # exports none of them
    ]
    facts = sla_signals(ready)
    v = facts["vllm"]
    assert (v.queue_p50_ms, v.queue_p99_ms) == pytest.approx((200.0, 600.0))  # the worst
    assert v.preemptions_per_s == 3.0 and v.prefix_cache_hit_rate == pytest.approx(0.3)
    assert (v.kv_blocks_total, v.kv_blocks_used, v.asleep) == (200.0, 40.0, True)
    s = facts["sglang"]
    assert (s.queue_p99_ms, s.preemptions_per_s, s.prefix_cache_hit_rate, s.asleep,
            s.kv_blocks_total) == (None, None, None, None, None)
