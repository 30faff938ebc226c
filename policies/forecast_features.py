"""The seasonal forecast's inputs (`policies.forecast`): the rate history on a grid of
bins, its daily level, the feature matrix, and which feature columns a fit needs.
Pure numpy on arrays; nothing here fits."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

SECONDS_PER_HOUR = 3600.0
SECONDS_PER_DAY = 86400.0
SECONDS_PER_WEEK = 7 * SECONDS_PER_DAY
LAG_SMOOTH_S = 1800.0                      # half-width of the lag smoothing window


def grid_means(times: FloatArray, rates: FloatArray, now: float, bin_s: float,
               past_bins: int, future_bins: int) -> FloatArray:
    """Mean rate per bin; bins [-past_bins, future_bins) relative to `now`; NaN = no data."""
    index = np.floor((times - now) / bin_s).astype(np.int64) + past_bins
    inside = (index >= 0) & (index < past_bins)
    total = np.bincount(index[inside], weights=rates[inside], minlength=past_bins + future_bins)
    count = np.bincount(index[inside], minlength=past_bins + future_bins)
    grid = np.full(past_bins + future_bins, np.nan)
    has = count > 0
    grid[has] = total[has] / count[has]
    return grid


def window_mean(grid: FloatArray, before: int, after: int) -> FloatArray:
    """nanmean of grid[i - before .. i + after] for every i (NaN where all are NaN)."""
    filled = np.where(np.isnan(grid), 0.0, grid)
    present = (~np.isnan(grid)).astype(np.float64)
    csum = np.concatenate([[0.0], np.cumsum(filled)])
    ccount = np.concatenate([[0.0], np.cumsum(present)])
    idx = np.arange(grid.size)
    lo = np.clip(idx - before, 0, grid.size)
    hi = np.clip(idx + after + 1, 0, grid.size)
    count = ccount[hi] - ccount[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, (csum[hi] - csum[lo]) / np.maximum(count, 1), np.nan)


def shift(values: FloatArray, lag: int) -> FloatArray:
    """`values` moved `lag` bins later (NaN before)."""
    out = np.full(values.size, np.nan)
    if lag < values.size:
        out[lag:] = values[: values.size - lag]
    return out


def daily_level(grid: FloatArray, bin_s: float, day_lag: int) -> tuple[FloatArray, FloatArray]:
    """(mean rate of the day ending at each bin, log level: that mean one day lag earlier)."""
    per_day = max(1, round(SECONDS_PER_DAY / bin_s))
    day_mean = window_mean(grid, per_day - 1, 0)
    return day_mean, np.log1p(shift(day_mean, day_lag))


def features(grid: FloatArray, bin_ts: FloatArray, bin_s: float, day_mean: FloatArray,
             level: FloatArray, day_lag: int, week_lag: int, start: int = 0,
             stop: int | None = None) -> FloatArray:
    """The feature matrix per bin; the target is log1p(rate) - log level. `start`, `stop`:
    only the rows of those bins, each the same figures as in the whole matrix (the
    element-wise functions see the same values)."""
    half = max(0, round(LAG_SMOOTH_S / bin_s))
    smooth = window_mean(grid, half, half)
    rows = slice(start, stop)
    level = level[rows]
    lag_day = np.log1p(shift(smooth, day_lag)[rows]) - level
    lag_week = np.log1p(shift(smooth, week_lag)[rows]) - level
    week_level = np.log1p(shift(day_mean, week_lag)[rows]) - level
    centre = bin_ts[rows] + bin_s / 2
    hour = 2 * np.pi * (centre % SECONDS_PER_DAY) / SECONDS_PER_DAY
    # 1970-01-01 was a Thursday: +3 days makes Monday 0.
    dow = 2 * np.pi * (((centre // SECONDS_PER_DAY) + 3) % 7) / 7
    return np.column_stack([np.sin(hour), np.cos(hour), np.sin(dow), np.cos(dow),
                            lag_day, lag_week, week_level])


def split_columns(x_train: FloatArray) -> npt.NDArray[np.bool_]:
    """The feature columns a tree can split on, without changing any tree: a column all
    NaN or constant (no NaN) gives one bin and never splits, and a copy of an earlier
    column ties with it at every split, which the boosting gives to the earlier column
    (with a horizon of whole weeks the day and week lags coincide and the week level is
    0). Dropping them only saves the histograms."""
    usable: npt.NDArray[np.bool_] = np.asarray(np.isfinite(x_train).any(axis=0))
    keep = usable.copy()
    for j in np.flatnonzero(usable):
        col = x_train[:, j]
        constant = not np.isnan(col).any() and float(col.min()) == float(col.max())
        if constant or any(keep[i] and np.array_equal(x_train[:, i], col, equal_nan=True)
                           for i in range(j)):
            keep[j] = False
    if not keep.any():  # every column constant: the trees are the baseline; give them one
        keep = usable & (np.cumsum(usable) == 1)
    return keep


def no_day_lag_rows(times: FloatArray, now: float, bin_s: float, past_bins: int,
                     day_lag: int) -> bool:
    """True when no sample has another a day lag earlier (the first days of a model): no
    bin can have a known level, so the seasonal model has no training row. Cheaper
    than building the grid to find out."""
    if times.size and bin_s > 0:
        # The bin index only grows with the time: when the earliest and the latest sample
        # fall inside, every one does, and they are the extremes (the same IEEE operations
        # on the two values as on the array).
        low = (float(times.min()) - now) / bin_s
        high = (float(times.max()) - now) / bin_s
        if math.isfinite(low) and math.isfinite(high):
            first, last = math.floor(low) + past_bins, math.floor(high) + past_bins
            if first >= 0 and last < past_bins:
                return last - first < day_lag
    index = np.floor((times - now) / bin_s).astype(np.int64) + past_bins
    inside = index[(index >= 0) & (index < past_bins)]
    return inside.size == 0 or int(inside.max()) - int(inside.min()) < day_lag


def median(values: FloatArray) -> float:
    """`numpy.median` of a non-empty 1-d array without NaN, to the bit: the middle value,
    or the middle two's sum halved (numpy's mean of two), from one partition, without
    numpy's per-call machinery (a forecast took two medians, the bulk of a fallback's
    cost)."""
    half = values.size // 2
    if values.size % 2:
        return float(np.partition(values, half)[half])
    part = np.partition(values, (half - 1, half))
    return (float(part[half - 1]) + float(part[half])) / 2


def quantiles(values: FloatArray, qs: tuple[float, ...]) -> list[float]:
    """`numpy.quantile` (linear method) of a non-empty 1-d array without NaN at each q in
    [0, 1], to the bit: the two order statistics around (n - 1) * q, interpolated by
    numpy's arithmetic (`_lerp`: from the lower one below the midpoint, from the upper one
    at or above it; past the last index both are the last value)."""
    ordered = np.sort(values)
    last = values.size - 1
    out = []
    for q in qs:
        virtual = last * q
        below = -1 if virtual >= last else math.floor(virtual)
        low = float(ordered[below])
        high = float(ordered[-1 if below == -1 else below + 1])
        gamma = virtual - below
        diff = high - low
        out.append(high - diff * (1 - gamma) if gamma >= 0.5 else low + diff * gamma)
    return out
