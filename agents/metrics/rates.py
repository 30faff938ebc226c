"""Turn successive engine snapshots into per-interval rates and latency quantiles.

`RateCalculator` is pure: it keeps the previous snapshot and its scrape time and,
given the next one, returns an `EngineSample`. Quantiles come from histogram
BUCKET DELTAS between the two scrapes, interpolated linearly inside the bucket
exactly as Prometheus' `histogram_quantile` does (written out here because
prometheus_client only exposes metrics, it does not query them).

Counters are tracked per series (label set: one per engine process behind the
deployment, per finish reason, ...). A series lower than before (its process
restarted) counts its new value as its delta; a series that appeared or vanished
counts nothing; either way the interval is marked partial (`counter_reset`). So one
process of several restarting never makes the others' whole totals count as one
interval. A histogram that went down counts from zero when it has a single series,
and gives no quantiles when several were summed (which of them restarted is not
known). Rates are never negative.

A scrape that holds a broken value in a series gearshift uses (NaN, ±Inf, a
negative counter, a KV-cache fraction above 1: `REFUSING_REASONS`) is refused:
no rates and no gauges from it, and the previous snapshot stays the base of the
next interval, which is then simply longer. Missing data is never read as zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from gearshift.agents.metrics.model import (
    ABSENT,
    REFUSING_REASONS,
    EngineSample,
    EngineSnapshot,
    Histogram,
    Labels,
    Quantiles,
    Skip,
    SkipReason,
    SleepState,
)
from gearshift.v1 import agent_pb2

SLEEP_STATES = {
    SleepState.AWAKE: agent_pb2.ENGINE_SLEEP_STATE_AWAKE,
    SleepState.WEIGHTS_OFFLOADED: agent_pb2.ENGINE_SLEEP_STATE_WEIGHTS_OFFLOADED,
    SleepState.DISCARD_ALL: agent_pb2.ENGINE_SLEEP_STATE_DISCARD_ALL,
}
P50 = 0.5
P99 = 0.99
UINT64_MAX = 2**64 - 1


def bucket_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """Prometheus `histogram_quantile` on cumulative (upper bound, count) buckets.

    Returns NaN when there is no observation or no finite bucket to interpolate in.
    Counts that decrease with the bound (a torn scrape) are made monotonic first,
    as Prometheus does.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    ordered = sorted(buckets)
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]):
        return math.nan
    fixed: list[tuple[float, float]] = []
    running_max = 0.0
    for bound, count in ordered:
        running_max = max(running_max, count)
        fixed.append((bound, running_max))
    total = fixed[-1][1]
    if total <= 0:
        return math.nan
    rank = q * total
    index = next(i for i, (_, count) in enumerate(fixed) if count >= rank)
    if index == len(fixed) - 1:
        return fixed[-2][0]  # in the +Inf bucket: the highest finite bound
    upper, count = fixed[index]
    if index == 0 and upper <= 0:
        return upper
    lower, below = (0.0, 0.0) if index == 0 else fixed[index - 1]
    in_bucket = count - below
    if in_bucket <= 0:
        return upper
    return lower + (upper - lower) * ((rank - below) / in_bucket)


def histogram_delta(previous: Histogram | None, current: Histogram) -> tuple[Histogram, bool]:
    """Observations in the interval, and whether a reset was detected.

    A reset (lower count or bucket, or a changed bucket layout) makes the current
    histogram itself the delta.
    """
    if previous is None:
        return current, False
    if previous.bounds() != current.bounds() or current.count < previous.count:
        return current, True
    deltas = [
        (bound, now - before)
        for (bound, now), (_, before) in zip(current.buckets, previous.buckets, strict=True)
    ]
    if any(delta < 0 for _, delta in deltas):
        return current, True
    total: float | None = None
    if current.sum is not None and previous.sum is not None:
        total = current.sum - previous.sum
        if total < 0:
            return current, True
    return Histogram(tuple(deltas), total, current.count - previous.count), False


def quantiles_of(delta: Histogram) -> Quantiles:
    """p50/p99/mean of the observations in `delta`; absent when there are none."""
    count = max(delta.count, delta.buckets[-1][1] if delta.buckets else 0.0)
    if count <= 0:
        return ABSENT
    p50 = bucket_quantile(P50, delta.buckets)
    p99 = bucket_quantile(P99, delta.buckets)
    mean = delta.sum / count if delta.sum is not None else math.nan
    # With only a +Inf bucket (or no `_sum`) one estimate stands in for the other.
    if math.isnan(p50):
        p50 = mean
    if math.isnan(p99):
        p99 = mean
    if math.isnan(mean):
        mean = p50
    if math.isnan(p50):
        return ABSENT
    return Quantiles(present=True, p50_s=p50, p99_s=p99, mean_s=mean, count=round(count))


def _counter_delta(previous: float | None, current: float | None) -> tuple[float | None, bool]:
    if current is None or previous is None:
        return None, False
    if current < previous:
        return current, True
    return current - previous, False


def series_delta(previous: dict[Labels, float], current: dict[Labels, float]) -> tuple[float, bool]:
    """The increase of a counter summed over its series, and whether it is partial
    (a series reset, appeared or vanished)."""
    delta = 0.0
    partial = len(previous) != len(current)
    for labels, now in current.items():
        before = previous.get(labels)
        if before is None:
            partial = True  # its count so far may span many intervals: not this one's
        elif now < before:
            delta += now
            partial = True
        else:
            delta += now - before
    return delta, partial


class RateCalculator:
    """Rates and quantiles for one deployment from successive snapshots."""

    def __init__(self) -> None:
        self._previous: EngineSnapshot | None = None
        self._previous_at: float | None = None

    def reset(self) -> None:
        """Forget the previous snapshot (e.g. the deployment was restarted on purpose)."""
        self._previous = None
        self._previous_at = None

    def update(self, snapshot: EngineSnapshot, now: float) -> EngineSample:
        """The sample for the interval ending at `now` (seconds, any monotonic clock)."""
        base = EngineSample(
            metrics_present=False,
            scraped_at=now,
            running_requests=snapshot.running or 0.0,
            waiting_requests=snapshot.waiting or 0.0,
            kv_cache_usage=min(1.0, max(0.0, snapshot.kv_cache_usage or 0.0)),
            errors_total=round(snapshot.request_errors or 0.0),
            sleep_state=snapshot.sleep_state,
            kv_blocks_total=_count(snapshot.kv_blocks_total),
            kv_blocks_used=_count(snapshot.kv_blocks_used),
            skips=snapshot.skips,
        )
        previous, previous_at = self._previous, self._previous_at
        if previous_at is not None and now <= previous_at:
            skip = Skip(
                SkipReason.CLOCK, f"scrape time {now} is not after the previous one {previous_at}"
            )
            return replace(base, reason=skip.detail, skips=(*snapshot.skips, skip))
        broken = [skip for skip in snapshot.skips if skip.reason in REFUSING_REASONS]
        if broken:  # the previous snapshot stays the base: the next interval is longer
            return EngineSample(metrics_present=False, scraped_at=now, refused=True,
                                reason="scrape refused: " + "; ".join(s.detail for s in broken[:3]),
                                skips=snapshot.skips)
        self._previous, self._previous_at = snapshot, now
        if previous is None or previous_at is None:
            return replace(base, reason="first scrape: rates need a second one")
        interval_s = now - previous_at
        resets: list[bool] = []

        def increase(name: str, before: float | None, after: float | None) -> float | None:
            parts_before, parts_after = previous.series_of(name), snapshot.series_of(name)
            if parts_before is not None and parts_after is not None:
                total, reset = series_delta(parts_before, parts_after)
                delta: float | None = total
            else:
                delta, reset = _counter_delta(before, after)
            resets.append(reset)
            return delta

        def per_second(name: str, before: float | None, after: float | None) -> float:
            delta = increase(name, before, after)
            rate = delta / interval_s if delta is not None else 0.0
            return rate if math.isfinite(rate) else 0.0

        def ratio(numerator: float | None, denominator: float | None) -> float | None:
            if numerator is None or denominator is None or denominator <= 0:
                return None
            value = numerator / denominator
            return value if math.isfinite(value) else None

        def mean_length(before: Histogram | None, after: Histogram | None, counter: str,
                        finished: float | None) -> float | None:
            """Per finished request: the length histogram's mean, else the token
            counter's increase over the finished requests'."""
            if before is not None and after is not None:
                delta, reset = histogram_delta(before, after)
                if not (reset and max(before.series, after.series) > 1) and delta.sum is not None:
                    return ratio(delta.sum, delta.count)
                return None
            return ratio(increase(counter, getattr(previous, counter),
                                  getattr(snapshot, counter)), finished)

        def latency(before: Histogram | None, after: Histogram | None) -> Quantiles:
            if after is None or before is None:
                return ABSENT  # the family just appeared: its counts are not this interval's
            delta, reset = histogram_delta(before, after)
            resets.append(reset)
            if reset and max(before.series, after.series) > 1:
                return ABSENT  # some process restarted: the sum is no interval's count
            return quantiles_of(delta)

        finished: float | None = None
        if snapshot.requests_finished is not None and previous.requests_finished is not None:
            finished = increase("requests_finished", previous.requests_finished,
                                snapshot.requests_finished)
            request_rate = (finished or 0.0) / interval_s
            if not math.isfinite(request_rate):
                request_rate = 0.0
        else:
            request_rate = (snapshot.completed_in_window or 0.0) / interval_s
            if not math.isfinite(request_rate):
                request_rate = 0.0
        return replace(
            base,
            metrics_present=True,
            interval_s=interval_s,
            request_rate=request_rate,
            ttft=latency(previous.ttft, snapshot.ttft),
            itl=latency(previous.itl, snapshot.itl),
            e2e=latency(previous.e2e, snapshot.e2e),
            prompt_tokens_per_s=per_second(
                "prompt_tokens", previous.prompt_tokens, snapshot.prompt_tokens
            ),
            generation_tokens_per_s=per_second(
                "generation_tokens", previous.generation_tokens, snapshot.generation_tokens
            ),
            queue_time=latency(previous.queue_time, snapshot.queue_time),
            preemptions_per_s=(
                per_second("preemptions", previous.preemptions, snapshot.preemptions)
                if previous.preemptions is not None and snapshot.preemptions is not None
                else None),
            prefix_cache_hit_rate=self._hit_rate(previous, snapshot, increase, ratio),
            mean_prompt_tokens=mean_length(previous.prompt_length, snapshot.prompt_length,
                                           "prompt_tokens", finished),
            mean_generation_tokens=mean_length(previous.generation_length,
                                               snapshot.generation_length,
                                               "generation_tokens", finished),
            counter_reset=any(resets),
        )

    @staticmethod
    def _hit_rate(previous: EngineSnapshot, snapshot: EngineSnapshot,
                  increase: Callable[[str, float | None, float | None], float | None],
                  ratio: Callable[[float | None, float | None], float | None]) -> float | None:
        """Prefix-cache hits over queries in the interval (None without queries); the
        engine's own gauge where it has no counters."""
        if snapshot.prefix_cache_queries is None or previous.prefix_cache_queries is None:
            return snapshot.prefix_cache_hit_rate
        hits = increase("prefix_cache_hits", previous.prefix_cache_hits,
                        snapshot.prefix_cache_hits)
        queries = increase("prefix_cache_queries", previous.prefix_cache_queries,
                           snapshot.prefix_cache_queries)
        rate = ratio(hits, queries)
        return None if rate is None else min(1.0, max(0.0, rate))


def to_proto(sample: EngineSample, target: agent_pb2.DeploymentReport) -> None:
    """Fill the engine-metric fields of `target`; identity and phase fields are left alone."""
    target.metrics_present = sample.metrics_present
    target.request_rate = sample.request_rate
    target.running_requests = sample.running_requests
    target.waiting_requests = sample.waiting_requests
    target.prompt_tokens_per_s = sample.prompt_tokens_per_s
    target.generation_tokens_per_s = sample.generation_tokens_per_s
    target.kv_cache_usage = sample.kv_cache_usage
    target.partial_interval = sample.counter_reset or sample.refused
    target.errors_total = _uint64(sample.errors_total)
    optional = (
        ("preemptions_per_s", sample.preemptions_per_s),
        ("prefix_cache_hit_rate", sample.prefix_cache_hit_rate),
        ("mean_prompt_tokens", sample.mean_prompt_tokens),
        ("mean_generation_tokens", sample.mean_generation_tokens),
        ("kv_blocks_total", None if sample.kv_blocks_total is None
         else _uint64(sample.kv_blocks_total)),
        ("kv_blocks_used", None if sample.kv_blocks_used is None
         else _uint64(sample.kv_blocks_used)),
    )
    for name, value in optional:
        if value is None:
            target.ClearField(name)
        else:
            setattr(target, name, value)
    target.sleep_state = SLEEP_STATES.get(sample.sleep_state,
                                          agent_pb2.ENGINE_SLEEP_STATE_UNSPECIFIED)
    for quantiles, message in (
        (sample.ttft, target.ttft),
        (sample.itl, target.itl),
        (sample.e2e, target.e2e),
        (sample.queue_time, target.queue_time),
    ):
        message.present = quantiles.present
        message.p50_s = quantiles.p50_s
        message.p99_s = quantiles.p99_s
        message.mean_s = quantiles.mean_s
        message.count = _uint64(quantiles.count)


def _count(value: float | None) -> int | None:
    return None if value is None or not math.isfinite(value) else round(value)


def _uint64(value: int) -> int:
    return min(max(0, value), UINT64_MAX)
