"""Capacity from load observations: the monotone fit, the SLA crossing and its band.

`estimate_metric` fits p99 latency as a non-decreasing function of load
(the pool-adjacent-violators algorithm, `isotonic_fit`: SciPy's
`isotonic_regression` to the last bit, without importing SciPy, over the
observations sorted by load, after dropping outliers: minutes whose p99 is over
10x the median p99 of every higher load, which no monotone curve can produce)
and returns the largest load at which the fit stays within the SLA,
interpolated in log latency between neighbours. The uncertainty band is the 5th..95th percentile of the same
estimate over bootstrap resamples of the observations. When every observed load
meets the SLA the result is only a lower bound (`status="lower_bound"`, the
highest load seen); when even the lowest one misses it, an upper bound. Too few
points, too narrow a load range, or mostly outliers give
`status="insufficient_data"` with the reason. `combine` takes the binding metric
of several. Nothing here raises on data.

`gain(a, b)` is the capacity ratio a/b with a confidence interval from the
ratios of the two estimates' bootstrap draws.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

BIN_RATIO = 1.02                  # width of a load bin (upper / lower bound)
MIN_POINTS = 10                   # observations with the metric needed to estimate
MIN_LOAD_RANGE = 1.3              # highest / lowest observed load needed
MIN_LOAD_BINS = 3                 # distinct load bins needed
OUTLIER_FACTOR = 10.0             # p99 this many times the median at higher loads
MAX_OUTLIER_SHARE = 0.2           # above this share of outliers: insufficient data
BOOTSTRAP_DRAWS = 200
BAND_PERCENTILES = (5.0, 95.0)
SUFFIX_MEAN_MARGIN = 1e-9         # relative: a fit this far under the SLA is clearly under it

Status = Literal["ok", "lower_bound", "upper_bound", "insufficient_data"]


@dataclass(frozen=True)
class CapacityEstimate:
    """Capacity per replica at the SLA, with a bootstrap band (req/s)."""

    status: Status
    capacity_rps: float | None
    low: float | None
    high: float | None
    points: int
    max_observed_rps: float
    reason: str = ""
    limited_by: str = ""                 # "ttft" or "itl": the metric that binds
    draws: tuple[float, ...] = ()        # bootstrap estimates (for gain intervals)


@dataclass(frozen=True)
class GainEstimate:
    """Capacity ratio a / b with a confidence interval."""

    ratio: float | None
    low: float | None
    high: float | None
    status: Status
    reason: str = ""


def outlier_mask(loads: FloatArray, lat: FloatArray) -> npt.NDArray[np.bool_]:
    """p99s far above what every higher load showed: impossible for a monotone curve."""
    flags = np.zeros(loads.size, dtype=bool)
    # Every median compared below is at least the smallest p99 (a middle value, or the mean
    # of two, each at least that), so with no p99 over OUTLIER_FACTOR times the smallest
    # none is flagged: the usual case, without the walk (NaN fails the test: walked).
    if not loads.size or float(lat.max()) <= OUTLIER_FACTOR * max(float(lat.min()), 1e-6):
        return flags
    order = np.argsort(loads)
    # The median of the p99s above each rank, from the top down over one sorted list
    # (the same figures as np.median of each suffix, in O(n log n) list work).
    above: list[float] = []
    for rank in range(loads.size - 1, -1, -1):
        i = int(order[rank])
        m = len(above)
        if m >= 3:
            median = above[m // 2] if m % 2 else (above[m // 2 - 1] + above[m // 2]) / 2
            if lat[i] > OUTLIER_FACTOR * max(median, 1e-6):
                flags[i] = True
        bisect.insort(above, float(lat[i]))
    return flags


def _group_medians(groups: npt.NDArray[np.int64], values: FloatArray
                   ) -> tuple[npt.NDArray[np.int64], FloatArray, FloatArray]:
    """(group ids, median of `values` per group, count per group), groups ascending."""
    order = np.lexsort((values, groups))
    g, v = groups[order], values[order]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    counts = np.diff(np.r_[starts, g.size])
    median = (v[starts + (counts - 1) // 2] + v[starts + counts // 2]) / 2
    return g[starts], median, counts.astype(np.float64)


def bin_medians(loads: FloatArray, lat: FloatArray) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Per load bin: median load, median p99, count (bins ascending)."""
    bins = np.floor(np.log(loads) / math.log(BIN_RATIO)).astype(np.int64)
    _, x, w = _group_medians(bins, loads)
    _, y, _ = _group_medians(bins, lat)
    return x, y, w


def isotonic_fit(values: list[float]) -> list[float]:
    """The non-decreasing least-squares fit of `values` (unit weights): the pool-adjacent-
    violators algorithm in the linear-time form of Busing (2022, J. Stat. Softw. 102(1),
    Algorithm 1) that SciPy's `isotonic_regression` implements, with its arithmetic (a
    merge restarts the block's sum as weight x mean; equal neighbours pool), so every
    value is SciPy's to the last bit (a test compares them)."""
    n = len(values)
    if n < 2:
        return list(values)
    x = list(values)              # block means, block k at x[k] while blocks form
    w = [1.0] * n                 # block weights
    ends = [0] * (n + 1)          # block k holds positions ends[k] .. ends[k + 1] - 1
    ends[1] = 1
    b = 0
    prev_mean, prev_weight = x[0], 1.0
    i = 1
    while i < n:
        b += 1
        mean, weight = x[i], 1.0
        if prev_mean >= mean:     # pool with the previous block
            b -= 1
            total = prev_weight * prev_mean + weight * mean
            weight += prev_weight
            mean = total / weight
            while i < n - 1 and mean >= x[i + 1]:      # and with the values ahead
                i += 1
                total += 1.0 * x[i]
                weight += 1.0
                mean = total / weight
            while b > 0 and x[b - 1] >= mean:          # and with earlier blocks
                b -= 1
                total += w[b] * x[b]
                weight += w[b]
                mean = total / weight
        x[b] = prev_mean = mean
        w[b] = prev_weight = weight
        ends[b + 1] = i + 1
        i += 1
    fit = [0.0] * n
    for k in range(b + 1):
        fit[ends[k]:ends[k + 1]] = [x[k]] * (ends[k + 1] - ends[k])
    return fit


def monotone_fit(loads: FloatArray, lat: FloatArray) -> tuple[FloatArray, FloatArray]:
    """(loads ascending, the non-decreasing least-squares fit of p99 at each)."""
    order = np.argsort(loads, kind="stable")
    y = lat[order]
    if y.size < 2:
        return loads[order], y.copy()
    return loads[order], np.array(isotonic_fit(y.tolist()), dtype=np.float64)


def _crossing(loads: FloatArray, lat: FloatArray, sla: float) -> tuple[float, Status]:
    return _crossing_of_fit(*monotone_fit(loads, lat), sla)


def _crossing_of_fit(x: FloatArray, fit: FloatArray, sla: float) -> tuple[float, Status]:
    """`_crossing` of the monotone fit `fit` at the loads `x` (ascending)."""
    above = np.nonzero(fit > sla)[0]
    if above.size == 0:
        return float(x[-1]), "lower_bound"
    j = int(above[0])
    if j == 0:
        return float(x[0]), "upper_bound"
    # Interpolate log latency: queueing curves are convex, a chord in linear space
    # would cross the SLA early.
    x0, x1 = x[j - 1], x[j]
    f0, f1, target = (math.log(max(v, 1e-9)) for v in (fit[j - 1], fit[j], sla))
    if x1 <= x0:
        return float(x0), "ok"
    return float(x0 + (target - f0) / (f1 - f0) * (x1 - x0)), "ok"


def _bootstrap(loads: FloatArray, lat: FloatArray, sla: float, draws: int,
               rng: np.random.Generator) -> list[float]:
    """The crossing of each of `draws` resamples of the observations, as `_crossing` gives
    it. A resample whose fit stays clearly under the SLA needs no fit: the isotonic fit's
    highest value is the largest mean of a suffix of the p99s sorted by load (the
    pool-adjacent-violators solution), so its crossing is its highest load (a lower
    bound). That is the usual case (a fleet sized with headroom), and the check is one
    array operation over every resample; the others are fitted one by one."""
    n = loads.size
    if draws <= 0:
        return []
    # One call draws what `draws` calls of n would, in the same order (the generator's
    # stream does not depend on how the draws are split; a test checks it).
    pick = rng.integers(0, n, (draws, n))
    # Each resample's p99s by load, ties in the resample's order (a stable argsort of its
    # loads), as one integer sort: key = the load's rank among the distinct loads * n
    # + the position in the row (unique keys, so any sort gives that order).
    distinct, rank = np.unique(loads, return_inverse=True)
    ranks = rank.astype(np.int64)[pick]
    keys = ranks * n + np.arange(n)
    keys.sort(axis=1)
    by_load = lat[np.take_along_axis(pick, keys % n, axis=1)]
    suffix_means = np.cumsum(by_load[:, ::-1], axis=1) / np.arange(1, n + 1)
    # The margin covers the rounding of either computation (relative 1e-13 at most).
    clear = (suffix_means.max(axis=1) < sla * (1 - SUFFIX_MEAN_MARGIN)).tolist()
    # Each resample's highest load: the distinct load of its highest rank. The resamples'
    # loads and p99s are gathered only for the fits (three gathers of every draw, not four).
    top = distinct[ranks.max(axis=1)].tolist()
    return [top[i] if clear[i] else _crossing(loads[pick[i]], lat[pick[i]], sla)[0]
            for i in range(draws)]


def estimate_metric(metric: str, loads: FloatArray, lat: FloatArray, sla: float, draws: int,
                    seed: int) -> tuple[str, CapacityEstimate]:
    """Capacity at `sla` for one metric's (load, p99) observations; returns (metric, estimate)."""
    top = float(loads.max()) if loads.size else 0.0

    def insufficient(reason: str, points: int) -> tuple[str, CapacityEstimate]:
        return metric, CapacityEstimate("insufficient_data", None, None, None, points, top,
                                        f"{metric}: insufficient data: {reason}", metric)

    if loads.size < MIN_POINTS:
        return insufficient(f"{loads.size} observation(s), need {MIN_POINTS}", int(loads.size))
    outliers = outlier_mask(loads, lat)
    share = float(outliers.mean())
    if share > MAX_OUTLIER_SHARE:
        return insufficient(f"{share:.0%} of the p99s are outliers (over {OUTLIER_FACTOR:g}x "
                            f"the latency at higher loads)", int(loads.size))
    loads, lat = loads[~outliers], lat[~outliers]
    low_load, high_load = float(loads.min()), float(loads.max())
    bins = np.unique(np.floor(np.log(loads) / math.log(BIN_RATIO)))
    if high_load / low_load < MIN_LOAD_RANGE or bins.size < MIN_LOAD_BINS:
        return insufficient(f"load range {low_load:.3g}..{high_load:.3g} rps is too narrow "
                            f"(need a ratio of {MIN_LOAD_RANGE} over {MIN_LOAD_BINS} load bins)",
                            int(loads.size))
    x, fitted = monotone_fit(loads, lat)
    expected = np.interp(loads, x, fitted)
    scatter = np.abs(np.log(np.maximum(lat, 1e-9) / np.maximum(expected, 1e-9)))
    if (noisy := float(np.mean(scatter > math.log(OUTLIER_FACTOR)))) > MAX_OUTLIER_SHARE:
        return insufficient(f"too noisy: {noisy:.0%} of the p99s are over {OUTLIER_FACTOR:g}x "
                            f"off the monotone fit", int(loads.size))
    value, status = _crossing_of_fit(x, fitted, sla)
    samples = _bootstrap(loads, lat, sla, draws, np.random.default_rng(seed))
    band = np.percentile(samples, BAND_PERCENTILES) if samples else np.array([value, value])
    notes = [f"{int(outliers.sum())} outlier p99(s) ignored"] if outliers.any() else []
    if status == "lower_bound":
        notes.insert(0, f"{metric} p99 within the SLA {sla:g}s at every observed load; "
                        f"capacity is at least {value:.3g} rps")
    elif status == "upper_bound":
        notes.insert(0, f"{metric} p99 above the SLA {sla:g}s even at the lowest observed load; "
                        f"capacity is at most {value:.3g} rps")
    low, high = min(float(band[0]), value), max(float(band[1]), value)
    return metric, CapacityEstimate(status, value, low, high, int(loads.size), top,
                                    "; ".join(notes), metric, tuple(samples))


def combine(results: list[tuple[str, CapacityEstimate]]) -> CapacityEstimate:
    """The binding metric gives the capacity: the lowest one (bounds stay bounds, since a
    lower bound is the highest load seen and an upper bound the lowest)."""
    missing = [e for _, e in results if e.status == "insufficient_data"]
    if missing:
        return missing[0]
    estimates = [e for _, e in results]
    best = min(estimates, key=lambda e: e.capacity_rps or 0.0)
    if len(estimates) == 1:
        return best
    draws = tuple(min(pair) for pair in zip(*(e.draws for e in estimates), strict=True))
    value = best.capacity_rps or 0.0
    low, high = np.percentile(draws, BAND_PERCENTILES) if draws else (value, value)
    return CapacityEstimate(best.status, value, min(float(low), value), max(float(high), value),
                            best.points, max(e.max_observed_rps for e in estimates),
                            "; ".join(e.reason for e in estimates if e.reason), best.limited_by,
                            draws)


def gain(a: CapacityEstimate, b: CapacityEstimate) -> GainEstimate:
    """Capacity of `a` relative to `b` (a / b) with a bootstrap confidence interval."""
    if (a.status == "insufficient_data" or b.status == "insufficient_data"
            or not a.capacity_rps or not b.capacity_rps):
        why = a.reason if a.status == "insufficient_data" else b.reason
        return GainEstimate(None, None, None, "insufficient_data", why or "no capacity measured")
    ratio = a.capacity_rps / b.capacity_rps
    if a.status == "ok" and b.status == "ok":
        status: Status = "ok"
    elif a.status in ("ok", "lower_bound") and b.status in ("ok", "upper_bound"):
        status = "lower_bound"
    elif a.status in ("ok", "upper_bound") and b.status in ("ok", "lower_bound"):
        status = "upper_bound"
    else:
        return GainEstimate(ratio, None, None, "insufficient_data",
                            f"both capacities are bounds in the same direction "
                            f"({a.status}, {b.status}): the ratio is unknown")
    n = min(len(a.draws), len(b.draws))
    if n == 0:
        return GainEstimate(ratio, ratio, ratio, status, "no bootstrap draws")
    # Independent estimates: pair the draws in a shuffled order.
    perm = np.random.default_rng(0).permutation(len(b.draws))[:n]
    ratios = np.asarray(a.draws[:n]) / np.asarray(b.draws)[perm]
    low, high = np.percentile(ratios, BAND_PERCENTILES)
    reason = "" if status == "ok" else f"capacities: {a.status} / {b.status}"
    return GainEstimate(ratio, min(float(low), ratio), max(float(high), ratio), status, reason)
