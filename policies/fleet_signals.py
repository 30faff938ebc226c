"""Signals of many models at once, from rates on one shared time axis (pure).

The live controller samples every model at the same times (`controller.rate_history`),
so a fleet's rates are rows of one matrix. `compute_fleet_signals` gives each model
exactly the `Signals` that `compute_signals` gives it from its own samples — the
same window indices, the same sequential prefix sums for the mean — with the
per-model work done once per block of rows by numpy: a policy tick over 10,000
models costs a few milliseconds of arithmetic instead of a Python walk over each
model's samples. A row with a gap (a model missing from some sample) is handed to
`compute_signals` on its own samples.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gearshift.common.frozen_records import fast_init
from gearshift.policies.signals import (
    SECONDS_PER_WEEK,
    ModelFacts,
    ModelHistory,
    Signals,
    SignalSettings,
    check_forecast_start,
    compute_signals,
)

if TYPE_CHECKING:
    from gearshift.policies.forecast import Forecast
    from gearshift.policies.model_history import RateArray
    from gearshift.policies.signals import FloatArray


@fast_init
@dataclass(frozen=True)
class FleetModel:
    """What a model's signals need besides its rates."""

    facts: ModelFacts
    revision_ts: list[float]  # sorted, epoch s
    forecast: Forecast | None = None


def compute_fleet_signals(axis: FloatArray, blocks: Iterable[tuple[list[str], RateArray]],
                          wanted: Mapping[str, FleetModel], now: float,
                          settings: SignalSettings, sample_period_s: float) -> dict[str, Signals]:
    """`compute_signals` of each model of `wanted` (models missing from `blocks` get none).

    `axis` holds the sample times (ascending) and each block (models, rates) one row of
    rates per model on it (float64 or float32: the figures are computed in float64 on the
    stored values), NaN where the model had no sample; a model in no block has no samples. The rows are read, not copied: the returned signals read them until the
    caller changes them."""
    import numpy as np

    for model, fm in wanted.items():
        check_forecast_start(model, fm.forecast, now)
    end = int(axis.searchsorted(now, side="left"))
    start = int(axis.searchsorted(now - settings.window_s, side="left"))
    long_start = int(axis.searchsorted(now - settings.long_window_s, side="left"))
    n = end - start
    history_s = (now - float(axis[0])) if end else 0.0
    weeks = max(min(history_s, settings.revision_window_s), SECONDS_PER_WEEK) / SECONDS_PER_WEEK
    out: dict[str, Signals] = {}
    scaled = {m for m, fm in wanted.items() if _scales(fm)}
    for models, rates in blocks:
        rows = [i for i, m in enumerate(models) if m in wanted]
        if not rows:
            continue
        gaps = np.isnan(rates).any(axis=1).tolist()
        if end:
            upto_start, upto_end = _prefix_sums(rates, start, end)
            current = rates[:, end - 1].tolist()
            ranges = _ranges(rates, end, (n, end - long_start))
            # each row's (length -> (lowest, highest)) over the window lengths
            lengths = [w for w, _, _ in ranges]
            known = [dict(zip(lengths, row, strict=True))
                     for row in zip(*(zip(lo, hi, strict=True) for _, lo, hi in ranges),
                                    strict=True)] if ranges else None
            stats = _order_stats(rates, end, n, settings.sustained_quantile,
                                 [i for i in rows if not gaps[i] and models[i] in scaled])
        for i in rows:
            model = models[i]
            fm = wanted[model]
            revs = fm.revision_ts
            if gaps[i]:
                have = ~np.isnan(rates[i])
                hist = ModelHistory.of(axis[have], rates[i][have], revs, sample_period_s)
                out[model] = compute_signals(model, hist, fm.facts, now, settings, fm.forecast)
                continue
            if end and known is not None:
                hist = ModelHistory.with_ranges(axis, rates[i], np.array(revs, dtype=np.float64),
                                                sample_period_s, end, known[i])
            else:
                hist = ModelHistory(axis, rates[i], np.array(revs, dtype=np.float64),
                                    sample_period_s)
            rev_end = bisect_left(revs, now)
            rev_start = bisect_left(revs, now - settings.revision_window_s)
            out[model] = Signals(
                model=model, now=now, facts=fm.facts, history_s=history_s,
                rps_current=current[i] if n else None,
                rps_mean=(upto_end[i] - upto_start[i]) / n if n else None,
                revisions_per_week=(rev_end - rev_start) / weeks,
                last_revision_ts=revs[rev_end - 1] if rev_end else None, window_samples=n,
                long_window_samples=end - long_start, _history=hist, _end=end, _settings=settings,
                forecast=fm.forecast, _stats=stats.get(i) if end else None)
    for model, fm in wanted.items():  # never sampled
        if model not in out:
            hist = ModelHistory.of([], [], fm.revision_ts, sample_period_s)
            out[model] = compute_signals(model, hist, fm.facts, now, settings, fm.forecast)
    return out


def _prefix_sums(rates: RateArray, start: int, end: int) -> tuple[list[float], list[float]]:
    """Each row's sums of its first `start` and first `end` rates in float64, as the prefix
    sums `compute_signals` takes of one model give them (`np.cumsum`: in order).

    A row whose sums are exact in float64 has the same sums in any order of addition, so
    those rows are summed by numpy's fast (pairwise) sum; the others in order. Exact: every
    rate is a multiple of g, the unit in the last place of its smallest magnitude (a rate
    with a larger exponent is a multiple of a larger power of two), so every partial sum
    is, and one under 2**53 g in magnitude (at most `end` times the largest rate) is a
    float64. The live history keeps float32 rates (24-bit significands): a row is exact
    unless its rates span more than about 2**29 / `end` between smallest and largest."""
    import numpy as np

    head = rates[:, :end]
    magnitude = np.abs(head)
    largest = magnitude.max(axis=1).astype(np.float64)
    smallest = magnitude.min(axis=1).astype(np.float64)
    if (zeros := np.flatnonzero(smallest == 0)).size:  # the smallest that is not 0
        some = magnitude[zeros]
        smallest[zeros] = np.min(some, axis=1, where=some > 0, initial=np.inf)
    bits = np.finfo(head.dtype).nmant + 1  # significand bits of the stored rates
    _, exponent = np.frexp(smallest)  # smallest = f * 2**exponent, 0.5 <= f < 1
    exact = (smallest == np.inf) | (end * largest < np.ldexp(1.0, exponent - bits + 53))
    upto_start = head[:, :start].sum(axis=1, dtype=np.float64)
    upto_end = upto_start + head[:, start:].sum(axis=1, dtype=np.float64)  # exact rows: exact
    inexact = np.flatnonzero(~exact)
    if inexact.size:
        csum = np.cumsum(head[inexact], axis=1, dtype=np.float64)
        upto_end[inexact] = csum[:, end - 1]
        upto_start[inexact] = csum[:, start - 1] if start else 0.0
    return upto_start.tolist(), upto_end.tolist()


def _ranges(rates: RateArray, end: int, lengths: tuple[int, ...]
            ) -> list[tuple[int, list[float], list[float]]]:
    """(n, lowest, highest) rate of every row over the last n samples before `end`, for
    each length n (`ModelHistory.window_range`, which the cost rule reads for each model:
    a minimum and a maximum are exact, so those of a block are each row's own)."""
    return [(n, (w := rates[:, end - n:end]).min(axis=1).tolist(), w.max(axis=1).tolist())
            for n in sorted({n for n in lengths if n > 0})]


def _scales(fm: FleetModel) -> bool:
    """The model's savings estimate scales its window to a forecast (`Signals.traffic_scale`),
    so it reads the window's sustained rate."""
    fc = fm.forecast
    return fc is not None and fc.status == "ok" and fc.sustained_rps is not None


def _order_stats(rates: RateArray, end: int, n: int, quantile: float,
                 rows: list[int]) -> dict[int, tuple[float, float]]:
    """(peak, sustained) of `rows` over the window (the last n samples before `end`), as
    `Signals` computes them one model at a time (a row's quantile does not depend on the
    other rows: the same figures, to the bit)."""
    import numpy as np

    if not n or not rows:
        return {}
    window = rates[rows, end - n:end]
    peaks = window.max(axis=1).tolist()
    sustained = np.quantile(window.astype(np.float64), quantile, axis=1).tolist()
    return {i: (peaks[k], sustained[k]) for k, i in enumerate(rows)}


__all__ = ["FleetModel", "compute_fleet_signals"]
