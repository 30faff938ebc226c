"""Signals per model, computed by a pure function from what was observed strictly
before `now` (docs/decisions.md), and the registry of signal names that policy conditions
may use (checked when a policy loads).

A model's rates are a `policies.model_history.ModelHistory` (numpy arrays: a 28-day
backtest evaluates hundreds of thousands of windows, and the window statistics are
vector operations). numpy is imported by the functions that compute: loading a policy
needs only the registry of names.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, overload

from gearshift.common.engines import BASELINE_ENGINE, CATALOG
from gearshift.common.frozen_records import fast_init
from gearshift.policies.model_history import ModelHistory
from gearshift.policies.model_history import count_replica_means as history_replica_means

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from gearshift.policies.forecast import Forecast

    FloatArray = npt.NDArray[np.float64]

SECONDS_PER_WEEK = 7 * 24 * 3600.0

_T = TypeVar("_T")


class _cached(Generic[_T]):
    """`functools.cached_property` without its lock: the value is computed on the first
    read and stored in the instance's ``__dict__``, which later reads find first. Python
    3.11's takes a lock on every first read, several times a `Signals`' other work (a
    backtest reads three of them from each of 80,000 signals)."""

    def __init__(self, fn: Callable[[Any], _T]) -> None:
        self._fn, self._name, self.__doc__ = fn, fn.__name__, fn.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _cached[_T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> _T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> _T | _cached[_T]:
        if obj is None:
            return self
        value = obj.__dict__[self._name] = self._fn(obj)
        return value


@fast_init
@dataclass(frozen=True)
class EngineFacts:
    """What was measured for one model on one engine; None = not measured yet."""

    capacity_rps: float | None = None  # per replica, at the SLA
    ttft_p99_ms: float | None = None
    itl_p99_ms: float | None = None
    cold_start_s: float | None = None
    build_s: float | None = None
    build_overhead_usd: float | None = None
    # SLA signals measured on the engine (docs/engines.md, "Signals for SLA policies").
    queue_p50_ms: float | None = None  # time requests waited before being scheduled
    queue_p99_ms: float | None = None
    preemptions_per_s: float | None = None
    prefix_cache_hit_rate: float | None = None  # 0..1
    asleep: bool | None = None  # a deployment's engine is in sleep mode (vLLM)
    mean_prompt_tokens: float | None = None
    mean_generation_tokens: float | None = None
    kv_blocks_total: float | None = None
    kv_blocks_used: float | None = None


# The citation key saying where an engine's latency figures come from: "measured" (the
# default: a live measurement, or a trace header's figures) or "prior" (the policy's).
LATENCY_SOURCE = "latency_source"
PRIOR_SOURCE = "prior"
# The citation key naming the release of an engine the figures are for
# (``engine_version.<engine>``), where it is known.
ENGINE_VERSION = "engine_version"
# When that release started to run in the fleet (epoch seconds), where it is known: a
# release newer than a model's choice of engine may be worth a trial (docs/decisions.md).
RELEASE_TS = "engine_release_ts"
# The capacity (req/s per replica) the engine's previous release had for the model, where
# it changed release: a measured figure under it is a regression (docs/decisions.md).
CAPACITY_EARLIER = "capacity_earlier"


@fast_init
@dataclass(frozen=True)
class ModelFacts:
    """Slow-moving facts about a model's deployment: sizing, SLA, hardware, engines."""

    gpus_per_replica: int
    min_replicas: int = 1
    headroom: float = 0.2
    overlap_s: float = 600.0
    sla_ttft_p99_ms: float | None = None
    sla_itl_p99_ms: float | None = None
    engines: Mapping[str, EngineFacts] = field(default_factory=dict)
    nvidia: bool | None = None
    gpu_model: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    price_per_gpu_hour: float | None = None
    price_source: str = ""  # where the live loop found the price ("none": nowhere); cited
    # Where the figures above came from (capacity sources, notes, bands), as decision
    # inputs: every decision on the model cites them.
    citations: Mapping[str, SignalValue] = field(default_factory=dict)


@dataclass(frozen=True)
class SignalSettings:
    """How signals are computed (the policy's `signals` section)."""

    window_s: float = 24 * 3600.0
    long_window_s: float = 7 * 24 * 3600.0
    sustained_quantile: float = 0.1
    revision_window_s: float = 14 * 24 * 3600.0


@fast_init
@dataclass(frozen=True)
class Signals:
    """One model's signals at `now`; rates in requests/s.

    The order statistics (peak, sustained, burstiness) are computed on first use:
    the cost rule does not need them, and a backtest evaluates many windows.
    """

    model: str
    now: float
    facts: ModelFacts
    history_s: float  # span of the samples seen so far
    rps_current: float | None
    rps_mean: float | None
    revisions_per_week: float
    last_revision_ts: float | None
    window_samples: int
    long_window_samples: int
    _history: ModelHistory = field(compare=False, repr=False)
    _end: int = field(compare=False, repr=False)  # samples before now: [0, _end)
    _settings: SignalSettings = field(compare=False, repr=False)
    # The traffic forecast made at or before `now` (None: none was made, e.g. a
    # backtest on the header's facts).
    forecast: Forecast | None = field(default=None, compare=False, repr=False)
    # (peak, sustained) when the caller computed them (`policies.fleet_signals`, for a
    # fleet at once); None: computed here on first use.
    _stats: tuple[float, float] | None = field(default=None, compare=False, repr=False)

    @property
    def replays(self) -> bool:
        """The signals read a replayed series (a backtest: `ModelHistory.replay`)."""
        return self._history.replay

    @_cached
    def forecast_unused(self) -> str | None:
        """Why the forecast does not set the traffic level; None when it does."""
        fc = self.forecast
        if fc is None:
            return "no forecast was made"
        if fc.status != "ok" or fc.sustained_rps is None:
            return f"forecast {fc.status}: {fc.reason}" if fc.reason else f"forecast {fc.status}"
        if not self.rps_sustained:
            return "the observed sustained rate is 0: nothing to scale to the forecast"
        return None

    @property
    def traffic_basis(self) -> str:
        """Where the traffic level of the savings estimate comes from: ``forecast`` (the
        forecast sustained rate) or ``observed`` (the window's sustained rate)."""
        return "observed" if self.forecast_unused is not None else "forecast"

    @property
    def traffic_level_rps(self) -> float | None:
        """The sustained rate the savings estimate assumes for the horizon."""
        if self.traffic_basis == "forecast":
            assert self.forecast is not None
            return self.forecast.sustained_rps
        return self.rps_sustained

    @_cached
    def traffic_scale(self) -> float:
        """traffic_level_rps / rps_sustained: how the window's traffic is scaled (1: observed)."""
        if self.traffic_basis == "observed":
            return 1.0
        assert self.forecast is not None and self.forecast.sustained_rps is not None
        return self.forecast.sustained_rps / (self.rps_sustained or 1.0)

    @_cached
    def _order_stats(self) -> tuple[float, float] | None:
        """(peak, sustained) over the window; None without samples."""
        n, end, h = self.window_samples, self._end, self._history
        if not n:
            return None
        if self._stats is not None:
            return self._stats
        q = self._settings.sustained_quantile
        if h.replay and n == round(self._settings.window_s / h.sample_period_s):
            peaks, lows = h.rolling_lists(n, q)
            return peaks[end - n], lows[end - n]
        import numpy as np

        from gearshift.policies.forecast_features import quantiles

        window = h.rps[end - n:end]  # float32 in the live history: the quantile in float64
        values = window.astype(np.float64)
        # numpy's quantile, to the bit, without its per-call machinery (a backtest's first
        # day takes one a model at every step); a NaN is left to numpy.
        sustained = (quantiles(values, (q,))[0] if np.isfinite(values).all()
                     else float(np.quantile(values, q)))
        return float(window.max()), sustained

    @property
    def rps_peak(self) -> float | None:
        """Highest rate in the window."""
        stats = self._order_stats
        return None if stats is None else stats[0]

    @property
    def rps_sustained(self) -> float | None:
        """The low quantile (`sustained_quantile`) of the rate over the window."""
        stats = self._order_stats
        return None if stats is None else stats[1]

    @property
    def burstiness(self) -> float | None:
        """Peak / mean over the window."""
        if self.rps_peak is None or self.rps_mean is None:
            return None
        return self.rps_peak / self.rps_mean if self.rps_mean > 0 else 1.0

    def replica_means(self, capacities: Sequence[float], headroom: float, min_replicas: int,
                      windows: Sequence[tuple[int, float]]) -> list[list[float]] | None:
        """Mean replicas an engine of each capacity would have needed over each window
        (samples, scale): the last `samples` samples, each rate multiplied by `scale`
        (`ModelHistory.replica_means`: a row per capacity, a figure per window); None when
        a window has no samples."""
        end = self._end
        clipped = [(n if n < end else end, scale) for n, scale in windows]
        for n, _ in clipped:
            if n <= 0:
                return None
        return self._history.replica_means(self._end, capacities, headroom, min_replicas,
                                           clipped)


def count_replica_means(asks: Iterable[tuple[Signals, Sequence[float], float, int,
                                             Sequence[tuple[int, float]]]]) -> None:
    """`Signals.replica_means` for many models at once, each ask (signals, capacities,
    headroom, min_replicas, windows): one numpy pass over the models
    (`model_history.count_replica_means`); each model's signals then read their figures
    when asked the same, to the bit."""
    rows = []
    for sig, capacities, headroom, min_replicas, windows in asks:
        end = sig._end
        clipped = [(n if n < end else end, scale) for n, scale in windows]
        if all(n > 0 for n, _ in clipped):
            rows.append((sig._history, end, capacities, headroom, min_replicas, clipped))
    history_replica_means(rows)


def check_forecast_start(model: str, forecast: Forecast | None, now: float) -> None:
    """Refuse a forecast made after `now` (ValueError): it may have seen data from `now` on."""
    if forecast is not None and forecast.start_ts is not None and forecast.start_ts > now:
        raise ValueError(f"{model}: the forecast starts at {forecast.start_ts:.0f}, after now "
                         f"({now:.0f}): it may have seen data from now on")


def compute_signals(model: str, history: ModelHistory, facts: ModelFacts, now: float,
                    settings: SignalSettings, forecast: Forecast | None = None) -> Signals:
    """Signals from samples with timestamp < `now` only (pure).

    `forecast` must have been made at or before `now` (from samples before its
    origin); one made later could have seen data from `now` on and is refused."""
    check_forecast_start(model, forecast, now)
    find = history.index_before
    end = find(now)
    start = find(now - settings.window_s)
    long_start = find(now - settings.long_window_s)
    history_s = (now - float(history.sample_ts[0])) if end else 0.0
    revs = history.revision_list()
    rev_end = bisect_left(revs, now)
    rev_start = bisect_left(revs, now - settings.revision_window_s)
    # Fewer than a week of history counts as a week, so one early revision is not
    # read as a weekly habit.
    weeks = max(min(history_s, settings.revision_window_s), SECONDS_PER_WEEK) / SECONDS_PER_WEEK
    n = end - start
    mean = current = None
    if n:
        if history.replay:  # many windows of one series: prefix sums once
            prefix = history.prefix_rps()
            mean = (prefix[end] - prefix[start]) / n
        else:  # one window (a live tick): the same prefix sums, up to `end` only
            import numpy as np

            csum = np.cumsum(history.rps[:end], dtype=np.float64)
            mean = (float(csum[end - 1]) - (float(csum[start - 1]) if start else 0.0)) / n
        current = float(history.rps[end - 1])
    return Signals(
        model=model, now=now, facts=facts, history_s=history_s, rps_current=current,
        rps_mean=mean, revisions_per_week=(rev_end - rev_start) / weeks,
        last_revision_ts=revs[rev_end - 1] if rev_end else None, window_samples=n,
        long_window_samples=end - long_start, _history=history, _end=end, _settings=settings,
        forecast=forecast,
    )


# ---- the registry of signal names usable in policy conditions -------------------

SignalKind = Literal["number", "bool", "string"]
SignalValue = float | str | bool | None


@fast_init
@dataclass(frozen=True)
class SignalView:
    """What a condition can read: the signals plus the model's current engine."""

    signals: Signals
    engine: str
    dwell_s: float | None
    net_savings_usd: float | None = None  # of the best other engine over the horizon


@dataclass(frozen=True)
class SignalSpec:
    kind: SignalKind
    unit: str
    help: str
    read: Callable[[SignalView], SignalValue]
    bounds: tuple[float, float] | None = None  # every value lies within (policy warnings)


def _engine_fact(engine: str, name: str) -> Callable[[SignalView], SignalValue]:
    def read(v: SignalView) -> SignalValue:
        facts = v.signals.facts.engines.get(engine)
        return None if facts is None else getattr(facts, name)
    return read


def _current_fact(name: str) -> Callable[[SignalView], SignalValue]:
    def read(v: SignalView) -> SignalValue:
        facts = v.signals.facts.engines.get(v.engine)
        return None if facts is None else getattr(facts, name)
    return read


def _capacity_gain(engine: str) -> Callable[[SignalView], SignalValue]:
    def read(v: SignalView) -> SignalValue:
        e = v.signals.facts.engines
        base = e.get(BASELINE_ENGINE, EngineFacts()).capacity_rps
        mine = e.get(engine, EngineFacts()).capacity_rps
        return None if not base or mine is None else mine / base - 1.0
    return read


def _forecast_figure(v: SignalView, name: str) -> SignalValue:
    fc = v.signals.forecast
    return None if fc is None or fc.status != "ok" else getattr(fc, name)  # type: ignore[no-any-return]


def _sla_ok(v: SignalView) -> SignalValue:
    return meets_sla(v.signals.facts, v.engine)


def _queue_share(v: SignalView) -> SignalValue:
    return queue_share_of_ttft_sla(v.signals.facts, v.engine)


def queue_share_of_ttft_sla(facts: ModelFacts, engine: str) -> float | None:
    """Queue p99 / TTFT p99 target on `engine`: the share of the TTFT budget spent
    waiting to be scheduled; None when either is unknown."""
    ef = facts.engines.get(engine)
    if ef is None or ef.queue_p99_ms is None or not facts.sla_ttft_p99_ms:
        return None
    return ef.queue_p99_ms / facts.sla_ttft_p99_ms


def _kv_blocks_free(v: SignalView) -> SignalValue:
    ef = v.signals.facts.engines.get(v.engine)
    if ef is None or ef.kv_blocks_total is None or ef.kv_blocks_used is None:
        return None
    return max(0.0, ef.kv_blocks_total - ef.kv_blocks_used)


def breach_is_measured(facts: ModelFacts, engine: str) -> bool:
    """`engine` breaks the latency SLA by a measured figure (not a policy prior)."""
    return (meets_sla(facts, engine) is False
            and facts.citations.get(f"{LATENCY_SOURCE}.{engine}") != PRIOR_SOURCE)


def meets_sla(facts: ModelFacts, engine: str) -> bool | None:
    """True/False when measured on `engine`; None when nothing is measured yet."""
    ef = facts.engines.get(engine)
    if ef is None:
        return None
    # Written out (no lists): every model of a fleet asks this of each engine at every tick.
    ttft, ttft_sla = ef.ttft_p99_ms, facts.sla_ttft_p99_ms
    itl, itl_sla = ef.itl_p99_ms, facts.sla_itl_p99_ms
    ttft_known = ttft is not None and ttft_sla is not None
    itl_known = itl is not None and itl_sla is not None
    if not ttft_known and not itl_known:
        return None
    return (not ttft_known or ttft <= ttft_sla) and (not itl_known or itl <= itl_sla)  # type: ignore[operator]


SIGNALS: dict[str, SignalSpec] = {
    "rps_current": SignalSpec("number", "req/s", "last rate sample", lambda v: v.signals.rps_current),
    "rps_sustained": SignalSpec("number", "req/s", "low quantile of the rate over the window",
                                lambda v: v.signals.rps_sustained),
    "rps_peak": SignalSpec("number", "req/s", "highest rate in the window", lambda v: v.signals.rps_peak),
    "rps_mean": SignalSpec("number", "req/s", "mean rate over the window", lambda v: v.signals.rps_mean),
    "forecast_sustained_rps": SignalSpec(
        "number", "req/s", "forecast low quantile (sustainedQuantile) of the rate over the horizon",
        lambda v: _forecast_figure(v, "sustained_rps")),
    "forecast_peak_rps": SignalSpec("number", "req/s", "forecast peak of the rate over the horizon",
                                    lambda v: _forecast_figure(v, "peak_rps")),
    "burstiness": SignalSpec("number", "ratio", "peak / mean rate over the window",
                             lambda v: v.signals.burstiness),
    "revisions_per_week": SignalSpec("number", "1/week", "new weights per week (revision window)",
                                     lambda v: v.signals.revisions_per_week),
    "history_h": SignalSpec("number", "h", "how long the model has been observed",
                            lambda v: v.signals.history_s / 3600.0),
    "ttft_p99_ms": SignalSpec("number", "ms", "measured TTFT p99 on the current engine",
                              _current_fact("ttft_p99_ms")),
    "itl_p99_ms": SignalSpec("number", "ms", "measured ITL p99 on the current engine",
                             _current_fact("itl_p99_ms")),
    "sla_ttft_p99_ms": SignalSpec("number", "ms", "TTFT p99 target",
                                  lambda v: v.signals.facts.sla_ttft_p99_ms),
    "sla_ok": SignalSpec("bool", "", "the current engine meets every latency target", _sla_ok),
    # SLA signals of the current engine, from its engines' own metrics (docs/engines.md).
    "queue_p50_ms": SignalSpec("number", "ms", "measured queue time p50 on the current engine "
                               "(waiting before being scheduled)", _current_fact("queue_p50_ms"),
                               (0.0, math.inf)),
    "queue_p99_ms": SignalSpec("number", "ms", "measured queue time p99 on the current engine",
                               _current_fact("queue_p99_ms"), (0.0, math.inf)),
    "queue_share_of_ttft_sla": SignalSpec(
        "number", "ratio", "queue time p99 / TTFT p99 target on the current engine: the share "
        "of the TTFT budget spent waiting (rises before TTFT breaks)", _queue_share,
        (0.0, math.inf)),
    "preemptions_per_s": SignalSpec("number", "req/s", "requests preempted (or retracted) per "
                                    "second on the current engine",
                                    _current_fact("preemptions_per_s"), (0.0, math.inf)),
    "prefix_cache_hit_rate": SignalSpec("number", "ratio", "prefix-cache hits / queries on the "
                                        "current engine", _current_fact("prefix_cache_hit_rate"),
                                        (0.0, 1.0)),
    "engine_asleep": SignalSpec("bool", "", "a deployment's engine is in sleep mode (vLLM: "
                                "looks idle, serves nothing)", _current_fact("asleep")),
    "mean_prompt_tokens": SignalSpec("number", "tokens", "mean prompt length per request on the "
                                     "current engine", _current_fact("mean_prompt_tokens"),
                                     (0.0, math.inf)),
    "mean_generation_tokens": SignalSpec("number", "tokens", "mean generated tokens per request "
                                         "on the current engine",
                                         _current_fact("mean_generation_tokens"), (0.0, math.inf)),
    "kv_blocks_total": SignalSpec("number", "blocks", "KV-cache blocks of the current engine's "
                                  "deployments (or token slots, by engine)",
                                  _current_fact("kv_blocks_total"), (0.0, math.inf)),
    "kv_blocks_free": SignalSpec("number", "blocks", "KV-cache blocks not in use on the current "
                                 "engine's deployments", _kv_blocks_free, (0.0, math.inf)),
    **{f"capacity_rps.{e.name}": SignalSpec("number", "req/s",
                                            f"measured {e.display_name} capacity per replica",
                                            _engine_fact(e.name, "capacity_rps"))
       for e in CATALOG},
    **{f"capacity_gain.{e.name}": SignalSpec(
        "number", "ratio", f"{e.display_name} capacity / {BASELINE_ENGINE} capacity - 1 (measured)",
        _capacity_gain(e.name)) for e in CATALOG if e.name != BASELINE_ENGINE},
    "net_savings_usd": SignalSpec("number", "USD",
                                  "expected savings of the best other engine over the horizon, "
                                  "net of switch and rebuild costs", lambda v: v.net_savings_usd),
    "nvidia": SignalSpec("bool", "", "the model's GPUs are NVIDIA", lambda v: v.signals.facts.nvidia),
    "gpu_model": SignalSpec("string", "", "GPU model name", lambda v: v.signals.facts.gpu_model),
    "engine": SignalSpec("string", "", "the current engine", lambda v: v.engine),
    "dwell_h": SignalSpec("number", "h", "time on the current engine",
                          lambda v: None if v.dwell_s is None else v.dwell_s / 3600.0),
}


# Names of the two-engine vocabulary, still accepted: old name -> its per-engine name.
DEPRECATED_SIGNALS: dict[str, str] = {
    "capacity_vllm_rps": "capacity_rps.vllm",
    "capacity_tensorrt_llm_rps": "capacity_rps.tensorrt-llm",
    "capacity_gain": "capacity_gain.tensorrt-llm",
}
SIGNALS.update({old: SIGNALS[new] for old, new in DEPRECATED_SIGNALS.items()})


def is_number(value: SignalValue) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


__all__ = ["DEPRECATED_SIGNALS", "LATENCY_SOURCE", "PRIOR_SOURCE", "SIGNALS", "EngineFacts",
           "ModelFacts", "ModelHistory", "SignalSettings", "SignalSpec", "SignalView", "Signals",
           "breach_is_measured", "check_forecast_start", "compute_signals", "count_replica_means", "meets_sla", "queue_share_of_ttft_sla"]
