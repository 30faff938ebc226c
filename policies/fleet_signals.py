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

from gearshift.policies.signals import (
    SECONDS_PER_WEEK,
    ModelFacts,
    ModelHistory,
    Signals,
    SignalSettings,
    compute_signals,
)

if TYPE_CHECKING:
    from gearshift.policies.forecast import Forecast
    from gearshift.policies.model_history import RateArray
    from gearshift.policies.signals import FloatArray


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
        fc = fm.forecast
        if fc is not None and fc.path_ts and fc.path_ts[0] > now:
            raise ValueError(f"{model}: the forecast starts at {fc.path_ts[0]:.0f}, after now "
                             f"({now:.0f}): it may have seen data from now on")
    end = int(axis.searchsorted(now, side="left"))
    start = int(axis.searchsorted(now - settings.window_s, side="left"))
    long_start = int(axis.searchsorted(now - settings.long_window_s, side="left"))
    n = end - start
    history_s = (now - float(axis[0])) if end else 0.0
    weeks = max(min(history_s, settings.revision_window_s), SECONDS_PER_WEEK) / SECONDS_PER_WEEK
    out: dict[str, Signals] = {}
    buffer = None  # the prefix sums of one block, reused (no fresh pages for every block)
    for models, rates in blocks:
        rows = [i for i, m in enumerate(models) if m in wanted]
        if not rows:
            continue
        gaps = np.isnan(rates).any(axis=1).tolist()
        if end:
            # The prefix sums `compute_signals` takes of one model, for every row at once
            # (a cumulative sum adds in order along each row: the same figures).
            if buffer is None or buffer.shape[0] < rates.shape[0]:
                buffer = np.empty((rates.shape[0], end))
            csum = np.cumsum(rates[:, :end], axis=1, dtype=np.float64,
                             out=buffer[:rates.shape[0]])
            upto_end = csum[:, end - 1].tolist()
            upto_start = csum[:, start - 1].tolist() if start else [0.0] * len(models)
            current = rates[:, end - 1].tolist()
        for i in rows:
            model = models[i]
            fm = wanted[model]
            revs = fm.revision_ts
            if gaps[i]:
                have = ~np.isnan(rates[i])
                hist = ModelHistory.of(axis[have], rates[i][have], revs, sample_period_s)
                out[model] = compute_signals(model, hist, fm.facts, now, settings, fm.forecast)
                continue
            hist = ModelHistory(axis, rates[i], np.array(revs, dtype=np.float64), sample_period_s)
            rev_end = bisect_left(revs, now)
            rev_start = bisect_left(revs, now - settings.revision_window_s)
            out[model] = Signals(
                model=model, now=now, facts=fm.facts, history_s=history_s,
                rps_current=current[i] if n else None,
                rps_mean=(upto_end[i] - upto_start[i]) / n if n else None,
                revisions_per_week=(rev_end - rev_start) / weeks,
                last_revision_ts=revs[rev_end - 1] if rev_end else None, window_samples=n,
                long_window_samples=end - long_start, _history=hist, _end=end, _settings=settings,
                forecast=fm.forecast)
    for model, fm in wanted.items():  # never sampled
        if model not in out:
            hist = ModelHistory.of([], [], fm.revision_ts, sample_period_s)
            out[model] = compute_signals(model, hist, fm.facts, now, settings, fm.forecast)
    return out


__all__ = ["FleetModel", "compute_fleet_signals"]
