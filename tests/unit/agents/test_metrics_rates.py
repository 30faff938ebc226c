"""Rate and quantile math on hand-built scrapes with known answers."""

from __future__ import annotations

import math

import pytest

from gearshift.agents.metrics import (
    ABSENT,
    EngineSample,
    EngineSnapshot,
    Histogram,
    Quantiles,
    RateCalculator,
    SkipReason,
    bucket_quantile,
    parse_prometheus_text,
    to_proto,
)
from gearshift.v1 import agent_pb2

TTFT_BOUNDS = ("0.05", "0.1", "0.2", "0.5", "1.0", "+Inf")


def vllm_text(
    *,
    finished: float = 0,
    aborted: float = 0,
    prompt: float = 0,
    generation: float = 0,
    running: float = 0,
    waiting: float = 0,
    kv: float = 0.0,
    ttft: dict[str, float] | None = None,
    ttft_sum: float = 0.0,
) -> str:
    """A vLLM /metrics body with the given cumulative values (ttft: per-bucket counts)."""
    labels = 'engine="0",model_name="m"'
    lines = [
        "# TYPE vllm:request_success_total counter",
        f'vllm:request_success_total{{{labels},finished_reason="stop"}} {finished}',
        f'vllm:request_success_total{{{labels},finished_reason="abort"}} {aborted}',
        "# TYPE vllm:prompt_tokens_total counter",
        f"vllm:prompt_tokens_total{{{labels}}} {prompt}",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{{{labels}}} {generation}",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{labels}}} {running}",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{labels}}} {waiting}",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{labels}}} {kv}",
        "# TYPE vllm:time_to_first_token_seconds histogram",
    ]
    per_bucket = ttft or {}
    cumulative = 0.0
    for le in TTFT_BOUNDS:
        cumulative += per_bucket.get(le, 0.0)
        lines.append(f'vllm:time_to_first_token_seconds_bucket{{{labels},le="{le}"}} {cumulative}')
    lines.append(f"vllm:time_to_first_token_seconds_sum{{{labels}}} {ttft_sum}")
    lines.append(f"vllm:time_to_first_token_seconds_count{{{labels}}} {cumulative}")
    return "\n".join(lines) + "\n"


def sample_after(first: str, second: str, interval_s: float = 10.0) -> EngineSample:
    calculator = RateCalculator()
    opening = calculator.update(parse_prometheus_text(first), now=100.0)
    assert not opening.metrics_present
    return calculator.update(parse_prometheus_text(second), now=100.0 + interval_s)


def test_hundred_observations_in_one_bucket_interpolate_inside_it() -> None:
    buckets = [(0.1, 0.0), (0.2, 100.0), (math.inf, 100.0)]
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.15)
    assert bucket_quantile(0.99, buckets) == pytest.approx(0.199)


def test_quantile_in_first_bucket_starts_at_zero_and_in_inf_bucket_is_highest_bound() -> None:
    assert bucket_quantile(0.5, [(0.4, 10.0), (math.inf, 10.0)]) == pytest.approx(0.2)
    assert bucket_quantile(0.99, [(0.4, 1.0), (math.inf, 10.0)]) == 0.4


def test_quantile_without_observations_or_inf_bucket_is_nan() -> None:
    assert math.isnan(bucket_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]))
    assert math.isnan(bucket_quantile(0.5, [(0.1, 3.0)]))
    with pytest.raises(ValueError, match="quantile"):
        bucket_quantile(1.5, [(0.1, 3.0), (math.inf, 3.0)])


def test_first_scrape_has_no_rates_but_reports_gauges() -> None:
    calculator = RateCalculator()
    sample = calculator.update(parse_prometheus_text(vllm_text(running=3, kv=0.5)), now=1.0)
    assert not sample.metrics_present
    assert "first scrape" in sample.reason
    assert sample.running_requests == 3
    assert sample.kv_cache_usage == 0.5
    assert sample.ttft == ABSENT


def test_rates_and_ttft_quantiles_from_bucket_deltas() -> None:
    before = vllm_text(finished=50, prompt=1000, generation=500, ttft={"0.05": 40}, ttft_sum=1.0)
    after = vllm_text(
        finished=150,
        aborted=4,
        prompt=3000,
        generation=4500,
        running=7,
        waiting=2,
        kv=0.3,
        ttft={"0.05": 40, "0.2": 100},
        ttft_sum=1.0 + 15.0,
    )
    sample = sample_after(before, after, interval_s=10.0)
    assert sample.metrics_present
    assert sample.interval_s == 10.0
    assert sample.request_rate == pytest.approx(10.4)  # (100 stop + 4 abort) / 10 s
    assert sample.errors_total == 4
    assert sample.prompt_tokens_per_s == pytest.approx(200.0)
    assert sample.generation_tokens_per_s == pytest.approx(400.0)
    assert (sample.running_requests, sample.waiting_requests) == (7, 2)
    assert sample.kv_cache_usage == pytest.approx(0.3)
    # The 40 earlier observations are not in the interval: all 100 new ones are in (0.1, 0.2].
    assert sample.ttft == Quantiles(
        present=True,
        p50_s=pytest.approx(0.15),
        p99_s=pytest.approx(0.199),
        mean_s=pytest.approx(0.15),
        count=100,
    )
    assert not sample.counter_reset


def test_no_observation_in_the_interval_is_absent_not_zero() -> None:
    text = vllm_text(finished=5, ttft={"0.1": 5}, ttft_sum=0.4)
    sample = sample_after(text, text)
    assert sample.metrics_present
    assert sample.request_rate == 0.0
    assert sample.ttft.present is False
    assert sample.itl.present is False  # this engine exposes no ITL at all


def test_counter_reset_starts_the_interval_from_zero() -> None:
    before = vllm_text(finished=1000, prompt=90000, ttft={"0.5": 1000}, ttft_sum=400)
    after = vllm_text(finished=20, prompt=600, ttft={"0.05": 20}, ttft_sum=0.5)
    sample = sample_after(before, after, interval_s=5.0)
    assert sample.counter_reset
    assert sample.request_rate == pytest.approx(4.0)
    assert sample.prompt_tokens_per_s == pytest.approx(120.0)
    assert sample.ttft.present and sample.ttft.count == 20
    assert sample.ttft.p50_s == pytest.approx(0.025)


def test_scrape_time_that_does_not_advance_gives_no_rates() -> None:
    calculator = RateCalculator()
    calculator.update(parse_prometheus_text(vllm_text(finished=1)), now=50.0)
    sample = calculator.update(parse_prometheus_text(vllm_text(finished=9)), now=50.0)
    assert not sample.metrics_present
    assert sample.skips[-1].reason is SkipReason.CLOCK
    later = calculator.update(parse_prometheus_text(vllm_text(finished=11)), now=60.0)
    assert later.request_rate == pytest.approx(1.0)


def test_histogram_first_seen_in_the_second_scrape_is_absent() -> None:
    calculator = RateCalculator()
    calculator.update(EngineSnapshot(requests_finished=0.0), now=0.0)
    ttft = Histogram(buckets=((0.1, 5.0), (math.inf, 5.0)), sum=0.2, count=5.0)
    sample = calculator.update(EngineSnapshot(requests_finished=5.0, ttft=ttft), now=1.0)
    assert sample.ttft.present is False
    assert sample.request_rate == 5.0


def test_drained_iteration_stats_give_the_rate_without_a_counter() -> None:
    calculator = RateCalculator()
    calculator.update(EngineSnapshot(completed_in_window=100.0, running=1.0), now=0.0)
    sample = calculator.update(EngineSnapshot(completed_in_window=6.0, running=2.0), now=2.0)
    assert sample.metrics_present
    assert sample.request_rate == pytest.approx(3.0)
    assert sample.running_requests == 2.0


def test_to_proto_fills_the_report_fields() -> None:
    sample = EngineSample(
        metrics_present=True,
        request_rate=2.5,
        running_requests=3,
        waiting_requests=1,
        ttft=Quantiles(True, 0.1, 0.4, 0.15, 12),
        e2e=Quantiles(True, 1.0, 2.0, 1.2, 12),
        prompt_tokens_per_s=100.0,
        generation_tokens_per_s=50.0,
        kv_cache_usage=0.42,
        errors_total=2,
    )
    report = agent_pb2.DeploymentReport(deployment_id="d1", model="m")
    to_proto(sample, report)
    assert report.deployment_id == "d1"
    assert report.metrics_present
    assert report.request_rate == 2.5
    assert (report.running_requests, report.waiting_requests) == (3, 1)
    assert (report.ttft.present, report.ttft.p50_s, report.ttft.p99_s) == (True, 0.1, 0.4)
    assert (report.ttft.mean_s, report.ttft.count) == (0.15, 12)
    assert report.itl.present is False
    assert report.e2e.count == 12
    assert report.prompt_tokens_per_s == 100.0
    assert report.generation_tokens_per_s == 50.0
    assert report.kv_cache_usage == pytest.approx(0.42)
    assert report.errors_total == 2
    # A later absent sample clears the earlier values.
    to_proto(EngineSample(metrics_present=False), report)
    assert not report.metrics_present and not report.ttft.present and report.ttft.count == 0
