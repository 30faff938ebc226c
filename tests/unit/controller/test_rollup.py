"""RollupAggregator math on hand-built reports with known answers."""

from __future__ import annotations

import asyncio
import math
from datetime import UTC, datetime

import pytest

from gearshift.common.errors import InvalidArgument
from gearshift.controller.ingest.rollup import RollupAggregator, to_rows, to_rows_in_slices
from gearshift.controller.store.tables import RollupRow
from gearshift.v1 import agent_pb2

T0 = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
M = T0.timestamp()  # start of the minute under test


def q(p50: float, p99: float, count: int) -> agent_pb2.Quantiles:
    return agent_pb2.Quantiles(present=True, p50_s=p50, p99_s=p99, mean_s=p50, count=count)


def rep(dep: str, **overrides) -> agent_pb2.DeploymentReport:  # type: ignore[no-untyped-def]
    fields = dict(deployment_id=dep, engine="vllm", engine_version="0.10.1", model="llama",
                  phase=agent_pb2.DEPLOYMENT_PHASE_READY, metrics_present=True)
    fields.update(overrides)
    return agent_pb2.DeploymentReport(**fields)


def only(rows: list[RollupRow]) -> RollupRow:
    assert len(rows) == 1, rows
    return rows[0]


def test_two_deployments_with_a_counter_reset() -> None:
    agg = RollupAggregator()
    # the minute before: gives d1 its errors_total baseline
    agg.add("h1", rep("d1", request_rate=1.0, errors_total=4), M - 30, "NVIDIA H100")
    agg.add("h1", rep("d1", request_rate=10.0, running_requests=4, waiting_requests=1,
                      generation_tokens_per_s=100, kv_cache_usage=0.2, ttft=q(0.1, 0.5, 90),
                      errors_total=5), M + 5, "NVIDIA H100")
    agg.add("h2", rep("d2", request_rate=5.0, running_requests=2, waiting_requests=0,
                      generation_tokens_per_s=50, kv_cache_usage=0.6, errors_total=100), M + 10)
    agg.add("h1", rep("d1", request_rate=20.0, running_requests=6, waiting_requests=3,
                      generation_tokens_per_s=300, kv_cache_usage=0.4, ttft=q(0.2, 0.3, 10),
                      errors_total=7), M + 35, "NVIDIA H100")
    agg.add("h2", rep("d2", request_rate=7.0, running_requests=2, waiting_requests=2,
                      generation_tokens_per_s=70, kv_cache_usage=0.8, ttft=q(0.4, 2.0, 1),
                      errors_total=3), M + 40)  # 3 < 100: d2 restarted, 3 new errors

    before = only(agg.flush_completed(M + 5))
    assert before.minute == datetime.fromtimestamp(M - 60, UTC)
    assert before.errors == 0  # a first report has no delta
    row = only(agg.flush_completed(M + 65))
    assert row.minute == T0 and (row.model, row.engine) == ("llama", "vllm")
    assert row.engine_version == "0.10.1" and row.gpu_model == "NVIDIA H100"
    assert row.reports == 4 and row.replicas == 2
    assert row.request_rate_mean == pytest.approx(15.0 + 6.0)
    assert row.request_rate_max == pytest.approx(27.0)  # totals after each report: 10, 15, 25, 27
    assert row.running_mean == pytest.approx(5.0 + 2.0)
    assert row.waiting_mean == pytest.approx(2.0 + 1.0)
    assert row.generation_tokens_per_s == pytest.approx(200.0 + 60.0)
    assert row.kv_cache_usage_mean == pytest.approx(0.5)
    assert row.ttft_p50_s == pytest.approx((0.1 * 90 + 0.2 * 10 + 0.4 * 1) / 101)
    # the slowest report (p99 2.0) holds 1 of 101 requests (< 1 %): skipped
    assert row.ttft_p99_s == pytest.approx(0.5)
    assert row.itl_p50_s is None and row.itl_p99_s is None and row.e2e_p99_s is None
    assert row.errors == (5 - 4) + (7 - 5) + 3


def test_p99_is_the_slowest_report_once_it_holds_one_percent() -> None:
    agg = RollupAggregator()
    agg.add("h1", rep("d1", itl=q(0.02, 0.05, 98), e2e=q(1.0, 4.0, 98)), M + 1)
    agg.add("h1", rep("d1", itl=q(0.03, 0.30, 2), e2e=q(1.0, 3.0, 2)), M + 2)
    row = only(agg.flush_all())
    assert row.itl_p99_s == pytest.approx(0.30)
    assert row.itl_p50_s == pytest.approx((0.02 * 98 + 0.03 * 2) / 100)
    assert row.e2e_p99_s == pytest.approx(4.0)
    assert row.ttft_p50_s is None and row.ttft_p99_s is None


def test_present_quantile_with_zero_count_weighs_as_one() -> None:
    agg = RollupAggregator()
    agg.add("h1", rep("d1", ttft=q(0.1, 0.2, 0)), M)
    agg.add("h1", rep("d1", ttft=q(0.3, 0.4, 0)), M + 1)
    row = only(agg.flush_all())
    assert row.ttft_p50_s == pytest.approx(0.2) and row.ttft_p99_s == pytest.approx(0.4)


def test_reports_without_metrics_count_for_nothing() -> None:
    agg = RollupAggregator()
    agg.add("h1", rep("d1", metrics_present=False, request_rate=50.0, errors_total=9), M)
    assert agg.flush_all() == []
    agg.add("h1", rep("d1", request_rate=2.0, errors_total=10), M + 60)
    agg.add("h1", rep("d2", metrics_present=False, request_rate=99.0), M + 61)
    row = only(agg.flush_all())
    assert row.replicas == 1 and row.reports == 1 and row.request_rate_mean == 2.0
    assert row.errors == 0  # the metrics-less report set no baseline


def test_minutes_complete_after_lateness_and_late_reports_are_dropped() -> None:
    agg = RollupAggregator(lateness_s=5.0)
    agg.add("h1", rep("d1", request_rate=1.0, errors_total=1), M + 59)
    assert agg.flush_completed(M + 64.9) == []
    assert agg.open_minutes == 1
    assert only(agg.flush_completed(M + 65)).request_rate_mean == 1.0
    agg.add("h1", rep("d1", request_rate=3.0, errors_total=2), M + 58)  # too late
    assert agg.late_reports == 1
    agg.add("h1", rep("d1", request_rate=4.0, errors_total=4), M + 66)
    row = only(agg.flush_completed(M + 200))
    assert row.reports == 1 and row.request_rate_mean == 4.0
    assert row.errors == 3  # the late report's errors move to the next accepted one
    assert agg.flush_completed(M + 300) == [] and agg.open_minutes == 0


def test_model_and_engine_are_separate_rows_in_time_order() -> None:
    agg = RollupAggregator()
    agg.add("h1", rep("a", request_rate=1.0), M + 61)
    agg.add("h1", rep("b", engine="tensorrt-llm", engine_version="1.0.0", request_rate=2.0), M + 1)
    agg.add("h2", rep("c", model="qwen", request_rate=3.0), M + 2)
    rows = agg.flush_all()
    assert [(r.model, r.engine, r.minute.timestamp() - M) for r in rows] == [
        ("llama", "tensorrt-llm", 0.0), ("qwen", "vllm", 0.0), ("llama", "vllm", 60.0)]
    assert rows[0].engine_version == "1.0.0"
    agg.add("h1", rep("a", request_rate=1.0), M + 100)
    assert agg.late_reports == 1  # flush_all closed the minutes it returned


@pytest.mark.parametrize("bad", [
    {"request_rate": math.nan},
    {"kv_cache_usage": math.inf},
    {"ttft": agent_pb2.Quantiles(present=True, p50_s=0.1, p99_s=math.nan, count=3)},
])
def test_non_finite_values_are_refused_and_change_nothing(bad: dict) -> None:
    agg = RollupAggregator()
    agg.add("h1", rep("d1", request_rate=1.0), M)
    with pytest.raises(InvalidArgument, match=r"deployment 'd1' from host 'h9'.*not a finite"):
        agg.add("h9", rep("d1", **bad), M + 1)
    with pytest.raises(InvalidArgument, match="not a finite"):
        agg.add("h9", rep("d1"), math.inf)
    row = only(agg.flush_all())
    assert row.reports == 1 and row.request_rate_mean == 1.0


def test_an_errors_baseline_is_forgotten_after_a_long_silence() -> None:
    from gearshift.controller.ingest.rollup import BASELINE_SWEEP_S, BASELINE_TTL_S

    agg = RollupAggregator()
    agg.add("h1", rep("d1", errors_total=10), M)
    agg.add("h2", rep("d2", errors_total=10), M)
    agg.flush_completed(M + 120)
    # d2 keeps reporting; d1 is silent for longer than the TTL plus one sweep period
    t2 = M + BASELINE_TTL_S + BASELINE_SWEEP_S
    agg.add("h2", rep("d2", errors_total=12), t2)
    assert only(agg.flush_completed(t2 + 120)).errors == 2
    t3 = t2 + 180
    agg.add("h1", rep("d1", errors_total=15), t3)
    agg.add("h2", rep("d2", errors_total=13), t3)
    assert only(agg.flush_completed(t3 + 120)).errors == 1  # d1 starts afresh; d2: 13 - 12


async def test_rows_in_slices_are_to_rows_and_let_the_loop_run_between_them() -> None:
    def minutes() -> RollupAggregator:
        agg = RollupAggregator()
        for i, model in enumerate(("llama", "qwen", "mistral")):
            agg.add("h1", rep(f"d{i}", model=model, request_rate=1.0 + i,
                              ttft=q(0.1, 0.2 + i, 10)), M + i)
        return agg

    expected = to_rows(minutes().pop_completed(M + 120))
    ran: list[int] = []
    loop = asyncio.get_running_loop()
    for i in range(3):  # callbacks due now: each runs at the first slice boundary after it
        loop.call_soon(ran.append, i)
    rows = await to_rows_in_slices(minutes().pop_completed(M + 120), slice_s=0.0)
    assert [r.model_dump() for r in rows] == [r.model_dump() for r in expected]
    assert len(rows) == 3 and ran == [0, 1, 2]  # the loop ran while the rows were built


def _p99_as_doubles(samples: list[tuple[float, int]]) -> float:
    """The p99 as computed with every weight held as a double (the rule of the module doc,
    numpy's float64 cumulative sum in the slowest-first order)."""
    import numpy as np

    values = np.array([v for v, _ in samples], dtype=np.float64)
    order = np.argsort(-values, kind="stable")
    cumulative = np.cumsum(np.array([float(w) for _, w in samples], dtype=np.float64)[order])
    need = sum(w for _, w in samples) * 0.01
    first = int(np.searchsorted(cumulative, need, side="left"))
    return float(values[order[min(first, len(order) - 1)]])


@pytest.mark.parametrize("counts", [
    [3, 100, 1, 4_000_000_000],  # all within 32 bits
    [5, (1 << 32) + 3, 100, 7],  # one past 32 bits: the weights become doubles
    [(1 << 60) + 1, 1, (1 << 53) + 1, 2, 100],  # past 2**53: doubles round, as they did
])
def test_p99_weights_past_32_bits_give_the_same_percentile(counts: list[int]) -> None:
    agg = RollupAggregator()
    p99s = [0.5, 0.25, 2.0, 0.25, 1.0][:len(counts)]
    for n, (p99, count) in enumerate(zip(p99s, counts, strict=True)):
        agg.add("h1", rep(f"d{n}", ttft=q(0.1, p99, count)), M + n)
    row = only(agg.flush_completed(M + 120))
    assert row.ttft_p99_s == _p99_as_doubles(list(zip(p99s, counts, strict=True)))
    assert row.ttft_p50_s == sum(0.1 * c for c in counts) / sum(counts)


def test_an_sla_signal_set_to_zero_counts_and_one_not_set_does_not() -> None:
    agg = RollupAggregator()
    agg.add("h1", rep("d1", prefix_cache_hit_rate=0.0, preemptions_per_s=-0.0,
                      mean_prompt_tokens=0.0), M + 1)
    agg.add("h1", rep("d1", prefix_cache_hit_rate=0.5), M + 2)
    row = only(agg.flush_completed(M + 120))
    assert row.prefix_cache_hit_rate == 0.25  # both reports: 0 and 0.5
    assert row.preemptions_per_s == 0.0  # set (to -0.0) in one report
    assert row.mean_prompt_tokens == 0.0
    assert row.mean_generation_tokens is None  # set in none


@pytest.mark.parametrize("samples", [
    [(0.5, 100)] * 5 + [(0.25, 100), (0.5, 100), (0.5, 100)],  # runs, broken and resumed
    [(0.2, 100)] * 300 + [(3.0, 2)] * 2 + [(0.2, 100)] * 3,  # the slow tail under 1 %
    [(0.0, 3), (-0.0, 3), (0.0, 3), (-0.0, 3)] * 30,  # zeros of both signs: no runs
    [(0.25, (1 << 53) + 1)] * 3 + [(0.5, 1)] * 2 + [(0.25, 7)] * 2,  # doubles that round
])
def test_p99_over_repeated_samples_is_the_percentile_of_every_sample(
        samples: list[tuple[float, int]]) -> None:
    agg = RollupAggregator()
    for n, (p99, count) in enumerate(samples):
        agg.add("h1", rep(f"d{n % 7}", ttft=q(0.1, p99, count)), M + n * 0.1)
    row = only(agg.flush_completed(M + 120))
    expected = _p99_as_doubles(samples)
    assert row.ttft_p99_s is not None
    assert (row.ttft_p99_s, math.copysign(1.0, row.ttft_p99_s)) \
        == (expected, math.copysign(1.0, expected))
