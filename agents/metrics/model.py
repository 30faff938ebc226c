"""Data types shared by the engine metric parsers, the rate calculator and the scraper.

A parser turns one scrape body into an `EngineSnapshot` (cumulative counters,
gauges, histograms, as the engine exposes them). The `RateCalculator` turns two
successive snapshots into an `EngineSample` (rates and quantiles over the
interval), which is what the agent reports. Series that cannot be used are not
errors: they are dropped and listed as `Skip`s with a reason from the bounded
`SkipReason` set, which is also the label set of the skipped-samples counter.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from gearshift.common.errors import InvalidArgument

Labels = tuple[tuple[str, str], ...]


class SleepState(enum.StrEnum):
    """vLLM's `vllm:engine_sleep_state`: a sleeping engine serves nothing yet looks idle."""

    AWAKE = "awake"
    WEIGHTS_OFFLOADED = "weights_offloaded"  # sleep level 1: weights in CPU memory, KV dropped
    DISCARD_ALL = "discard_all"              # sleep level 2: weights and KV dropped


class SkipReason(enum.StrEnum):
    """Why a scrape, or one series in it, was not used (bounded metric label set)."""

    UNPARSEABLE = "unparseable"  # the whole body is not the expected format
    NON_FINITE = "non_finite"  # NaN or ±Inf where a number is needed
    NEGATIVE = "negative"  # a counter, gauge or bucket below zero
    OUT_OF_RANGE = "out_of_range"  # e.g. a KV-cache fraction above 1, zero max blocks
    WRONG_TYPE = "wrong_type"  # JSON value of the wrong type
    BAD_LABEL = "bad_label"  # e.g. a histogram bucket whose `le` is not a number
    MISSING_FAMILY = "missing_family"  # the body parsed but holds no known metric
    HTTP_STATUS = "http_status"  # the endpoint answered with a non-200 status
    UNREACHABLE = "unreachable"  # connection refused, reset or timed out
    CLOCK = "clock"  # the scrape time did not advance


# A series with one of these is a broken value, not a missing one: the whole scrape is
# refused (no rates, no gauges from it) rather than read as zero or as a partial sum.
REFUSING_REASONS = frozenset({SkipReason.NON_FINITE, SkipReason.NEGATIVE, SkipReason.OUT_OF_RANGE})


@dataclass(frozen=True)
class Skip:
    """One dropped series or scrape: the reason (bounded) and a human-readable detail."""

    reason: SkipReason
    detail: str


class MetricsParseError(InvalidArgument):
    """A whole scrape body cannot be read; the message names the source and the place."""

    def __init__(self, message: str, reason: SkipReason = SkipReason.UNPARSEABLE) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Histogram:
    """A cumulative Prometheus histogram, summed over all its label sets.

    `buckets` are (upper bound, cumulative count) pairs sorted by bound; the last
    bound is always +Inf. `count` and `sum` are the `_count` and `_sum` series
    (`sum` is None when the scrape has no `_sum`).
    """

    buckets: tuple[tuple[float, float], ...]
    sum: float | None
    count: float
    series: int = 1  # label sets summed (engine processes): >1 makes a reset ambiguous

    def bounds(self) -> tuple[float, ...]:
        return tuple(bound for bound, _ in self.buckets)


@dataclass(frozen=True)
class EngineSnapshot:
    """What one scrape showed. `None` means "not exposed by this engine or scrape".

    Counters are cumulative since the engine started. `completed_in_window` is the
    number of requests finished since the previous read of a draining source
    (trtllm-serve's JSON `/metrics`), so it is already a delta.
    """

    requests_finished: float | None = None
    request_errors: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    ttft: Histogram | None = None
    itl: Histogram | None = None
    e2e: Histogram | None = None
    completed_in_window: float | None = None
    iter_latency_s: float | None = None
    # The SLA signals (docs/engines.md, "Signals for SLA policies").
    queue_time: Histogram | None = None
    preemptions: float | None = None           # counter
    prefix_cache_hits: float | None = None     # counter (tokens or blocks)
    prefix_cache_queries: float | None = None  # counter, same unit: hits + misses
    prefix_cache_hit_rate: float | None = None  # the engine's own gauge, without counters
    sleep_state: SleepState | None = None
    prompt_length: Histogram | None = None
    generation_length: Histogram | None = None
    kv_blocks_total: float | None = None
    kv_blocks_used: float | None = None
    skips: tuple[Skip, ...] = ()
    # Counters per label set (one per engine process, finish reason, ...), by field
    # name: deltas are taken per series, so one process restarting never makes the
    # others' whole totals count as one interval.
    counter_series: tuple[tuple[str, tuple[tuple[Labels, float], ...]], ...] = ()

    def series_of(self, name: str) -> dict[Labels, float] | None:
        for field_name, series in self.counter_series:
            if field_name == name:
                return dict(series)
        return None

    def has_data(self) -> bool:
        """True when at least one metric gearshift uses was found."""
        return any(
            value is not None
            for value in (
                self.requests_finished,
                self.request_errors,
                self.prompt_tokens,
                self.generation_tokens,
                self.running,
                self.waiting,
                self.kv_cache_usage,
                self.ttft,
                self.itl,
                self.e2e,
                self.completed_in_window,
                self.iter_latency_s,
                self.queue_time,
                self.preemptions,
                self.prefix_cache_queries,
                self.sleep_state,
                self.kv_blocks_total,
            )
        )


@dataclass(frozen=True)
class Quantiles:
    """Latency over one interval in seconds; `present=False` means no observation."""

    present: bool
    p50_s: float = 0.0
    p99_s: float = 0.0
    mean_s: float = 0.0
    count: int = 0


ABSENT = Quantiles(present=False)


@dataclass(frozen=True)
class EngineSample:
    """One deployment's engine metrics over the interval ending at `scraped_at`.

    `metrics_present` is False until two usable scrapes gave deltas, and whenever
    the latest scrape failed; `reason` then says why. Gauges (running, waiting,
    KV-cache usage) and `errors_total` are the latest values even without deltas.
    """

    metrics_present: bool
    scraped_at: float = 0.0
    interval_s: float = 0.0
    request_rate: float = 0.0
    running_requests: float = 0.0
    waiting_requests: float = 0.0
    ttft: Quantiles = ABSENT
    itl: Quantiles = ABSENT
    e2e: Quantiles = ABSENT
    prompt_tokens_per_s: float = 0.0
    generation_tokens_per_s: float = 0.0
    kv_cache_usage: float = 0.0
    errors_total: int = 0
    # SLA signals; None means "not exported by this engine or not measurable this interval".
    queue_time: Quantiles = ABSENT
    preemptions_per_s: float | None = None
    prefix_cache_hit_rate: float | None = None
    sleep_state: SleepState | None = None
    mean_prompt_tokens: float | None = None
    mean_generation_tokens: float | None = None
    kv_blocks_total: int | None = None
    kv_blocks_used: int | None = None
    counter_reset: bool = False  # an engine process restarted: the interval is partial
    refused: bool = False  # the scrape held broken values (NaN, out of range): not used
    reason: str = ""
    skips: tuple[Skip, ...] = field(default=())
