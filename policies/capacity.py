"""Capacity model per (model, engine, engine version, GPU model), learned from live rollups.

Each rollup minute gives one `LoadObservation`: the request rate per ready
replica and the p99 TTFT / ITL over that minute. `CapacityModel` keeps them in
bounded memory (load bins 2% wide on a log scale, the newest `per_bin`
observations in each, so a long quiet week cannot push out the few busy minutes
that show where the engine saturates) and serialises to plain JSON.

`estimate()` fits p99 latency as a non-decreasing function of load (scikit-learn
`isotonic_regression` over the observations sorted by load, after dropping
outliers: minutes whose p99 is over 10x the median p99 of every higher load,
which no monotone curve can produce) and returns the largest load at which the
fit stays within the SLA, interpolated in log latency between neighbours. The
uncertainty band is the 5th..95th percentile of the same estimate over
bootstrap resamples of the observations. When every observed load meets the SLA
the result is only a lower bound (`status="lower_bound"`, the highest load seen);
when even the lowest one misses it, an upper bound. Too few points, too narrow
a load range, or mostly outliers give `status="insufficient_data"` with the
reason; invalid observations (NaN, negative, idle minutes) are refused by
`add()` with the reason and counted. Nothing here raises on data.

`gain(a, b)` is the capacity ratio a/b with a confidence interval from the
ratios of the two estimates' bootstrap draws.
"""

from __future__ import annotations

import math
import zlib
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from sklearn.isotonic import isotonic_regression

from gearshift.controller.errors import InvalidArgument

FloatArray = npt.NDArray[np.float64]

SCHEMA_VERSION = 1
BIN_RATIO = 1.02                  # width of a load bin (upper / lower bound)
PER_BIN = 24                      # newest observations kept per load bin
MAX_BINS = 400                    # bins kept; the emptiest-oldest go first beyond this
MIN_POINTS = 10                   # observations with the metric needed to estimate
MIN_LOAD_RANGE = 1.3              # highest / lowest observed load needed
MIN_LOAD_BINS = 3                 # distinct load bins needed
OUTLIER_FACTOR = 10.0             # p99 this many times the median at higher loads
MAX_OUTLIER_SHARE = 0.2           # above this share of outliers: insufficient data
BOOTSTRAP_DRAWS = 200
BAND_PERCENTILES = (5.0, 95.0)

Status = Literal["ok", "lower_bound", "upper_bound", "insufficient_data"]
METRICS = ("ttft", "itl")


@dataclass(frozen=True)
class CapacityKey:
    """What a capacity is measured for."""

    model: str
    engine: str
    engine_version: str
    gpu_model: str

    def label(self) -> str:
        return f"{self.model} on {self.engine} {self.engine_version} ({self.gpu_model})"


@dataclass(frozen=True)
class LoadObservation:
    """One rollup interval of one deployment; None = the latency was not measured."""

    ts: float
    rps_per_replica: float
    ttft_p99_s: float | None
    itl_p99_s: float | None


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


@dataclass(frozen=True)
class CurvePoint:
    """One load bin of the fitted curve (for tables and plots)."""

    load_rps: float
    p99_median_s: float
    fitted_p99_s: float
    count: int


def _bin_of(rps: float) -> int:
    return math.floor(math.log(rps) / math.log(BIN_RATIO))


class CapacityModel:
    """Observations of one `CapacityKey`, in bounded memory, and the estimates from them."""

    def __init__(self, key: CapacityKey, *, per_bin: int = PER_BIN) -> None:
        if per_bin < 1:
            raise InvalidArgument(f"capacity model: per_bin must be >= 1, got {per_bin}")
        self.key = key
        self.per_bin = per_bin
        self._bins: dict[int, deque[LoadObservation]] = {}
        self.accepted = 0
        self.rejected: dict[str, int] = {}

    # --- incremental updates -----------------------------------------------------
    def add(self, obs: LoadObservation) -> str | None:
        """Keep `obs`; returns None, or why it was refused (and counts the refusal)."""
        reason = self._refusal(obs)
        if reason is not None:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1
            return reason
        bucket = self._bins.setdefault(_bin_of(obs.rps_per_replica), deque(maxlen=self.per_bin))
        bucket.append(obs)
        self.accepted += 1
        if len(self._bins) > MAX_BINS:
            stalest = min(self._bins, key=lambda b: (len(self._bins[b]), self._bins[b][-1].ts))
            del self._bins[stalest]
        return None

    def add_many(self, observations: Iterable[LoadObservation]) -> int:
        """Add each; returns how many were kept."""
        return sum(self.add(obs) is None for obs in observations)

    @staticmethod
    def _refusal(obs: LoadObservation) -> str | None:
        if not math.isfinite(obs.ts):
            return "timestamp not finite"
        if not math.isfinite(obs.rps_per_replica) or obs.rps_per_replica < 0:
            return "load NaN, infinite or negative"
        if obs.rps_per_replica == 0:
            return "idle (no requests)"
        if obs.ttft_p99_s is None and obs.itl_p99_s is None:
            return "no latency measured"
        for value in (obs.ttft_p99_s, obs.itl_p99_s):
            if value is not None and not (math.isfinite(value) and value >= 0):
                return "latency NaN, infinite or negative"
        return None

    def observations(self) -> list[LoadObservation]:
        """Every kept observation, by load."""
        return [obs for b in sorted(self._bins) for obs in self._bins[b]]

    def __len__(self) -> int:
        return sum(len(bucket) for bucket in self._bins.values())

    # --- persistence ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"version": SCHEMA_VERSION, "key": asdict(self.key), "per_bin": self.per_bin,
                "accepted": self.accepted, "rejected": dict(self.rejected),
                "observations": [[o.ts, o.rps_per_replica, o.ttft_p99_s, o.itl_p99_s]
                                 for o in self.observations()]}

    @classmethod
    def from_dict(cls, data: object, *, where: str = "capacity model") -> CapacityModel:
        """Inverse of `to_dict`; bad input raises `InvalidArgument` naming the field."""
        if not isinstance(data, dict):
            raise InvalidArgument(f"{where}: expected an object, got {type(data).__name__}")
        if data.get("version") != SCHEMA_VERSION:
            raise InvalidArgument(f"{where}: version {data.get('version')!r} is not "
                                  f"{SCHEMA_VERSION}")
        key = data.get("key")
        fields = ("model", "engine", "engine_version", "gpu_model")
        if not isinstance(key, dict) or any(not isinstance(key.get(f), str) for f in fields):
            raise InvalidArgument(f"{where}: 'key' must hold strings {', '.join(fields)}")
        per_bin = data.get("per_bin", PER_BIN)
        if isinstance(per_bin, bool) or not isinstance(per_bin, int) or per_bin < 1:
            raise InvalidArgument(f"{where}: 'per_bin' must be an integer >= 1, got {per_bin!r}")
        model = cls(CapacityKey(**{f: key[f] for f in fields}), per_bin=per_bin)
        rows = data.get("observations")
        if not isinstance(rows, list):
            raise InvalidArgument(f"{where}: 'observations' must be a list")
        for i, row in enumerate(rows):
            if (not isinstance(row, list) or len(row) != 4
                    or any(v is not None and (isinstance(v, bool) or not isinstance(v, int | float))
                           for v in row) or row[0] is None or row[1] is None):
                raise InvalidArgument(f"{where}: observations[{i}] must be "
                                      f"[ts, rps_per_replica, ttft_p99_s|null, itl_p99_s|null], "
                                      f"got {row!r}")
            model.add(LoadObservation(float(row[0]), float(row[1]),
                                      None if row[2] is None else float(row[2]),
                                      None if row[3] is None else float(row[3])))
        accepted, rejected = data.get("accepted", model.accepted), data.get("rejected", {})
        if isinstance(accepted, int) and not isinstance(accepted, bool):
            model.accepted = max(accepted, model.accepted)
        if isinstance(rejected, dict):
            model.rejected = {str(k): int(v) for k, v in rejected.items()
                              if isinstance(v, int) and not isinstance(v, bool)}
        return model

    # --- estimates -----------------------------------------------------------------
    def series(self, metric: str) -> tuple[FloatArray, FloatArray]:
        attr = "ttft_p99_s" if metric == "ttft" else "itl_p99_s"
        pairs = [(o.rps_per_replica, getattr(o, attr)) for o in self.observations()
                 if getattr(o, attr) is not None]
        if not pairs:
            return np.empty(0), np.empty(0)
        loads, lat = np.array(pairs, dtype=np.float64).T
        return loads, lat

    def curve(self, metric: str = "ttft") -> list[CurvePoint]:
        """Per load bin: median load, median p99 and the monotone fit (outliers removed)."""
        _check_metric(metric)
        loads, lat = self.series(metric)
        keep = ~_outliers(loads, lat)
        if int(keep.sum()) == 0:
            return []
        x, y, w = _bin_medians(loads[keep], lat[keep])
        fitted = np.interp(x, *_fit(loads[keep], lat[keep]))
        return [CurvePoint(float(a), float(b), float(c), int(n))
                for a, b, c, n in zip(x, y, fitted, w, strict=True)]

    def estimate(self, sla_ttft_p99_s: float | None = None, sla_itl_p99_s: float | None = None,
                 *, draws: int = BOOTSTRAP_DRAWS) -> CapacityEstimate:
        """Capacity at the SLA (the lower of the TTFT and ITL limits that are given)."""
        slas = {"ttft": sla_ttft_p99_s, "itl": sla_itl_p99_s}
        for name, sla in slas.items():
            if sla is not None and not (math.isfinite(sla) and sla > 0):
                raise InvalidArgument(f"capacity estimate: sla_{name}_p99_s must be > 0, got {sla}")
        if all(sla is None for sla in slas.values()):
            raise InvalidArgument("capacity estimate: give sla_ttft_p99_s or sla_itl_p99_s")
        seed = zlib.crc32(self.key.label().encode())
        results = [_estimate_metric(metric, *self.series(metric), sla, draws, seed)
                   for metric, sla in slas.items() if sla is not None]
        return _combine(results)


def _check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise InvalidArgument(f"unknown latency metric {metric!r}; known: {', '.join(METRICS)}")


def _outliers(loads: FloatArray, lat: FloatArray) -> npt.NDArray[np.bool_]:
    """p99s far above what every higher load showed: impossible for a monotone curve."""
    flags = np.zeros(loads.size, dtype=bool)
    order = np.argsort(loads)
    for rank, i in enumerate(order):
        above = lat[order[rank + 1:]]
        if above.size >= 3 and lat[i] > OUTLIER_FACTOR * max(float(np.median(above)), 1e-6):
            flags[i] = True
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


def _bin_medians(loads: FloatArray, lat: FloatArray) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Per load bin: median load, median p99, count (bins ascending)."""
    bins = np.floor(np.log(loads) / math.log(BIN_RATIO)).astype(np.int64)
    _, x, w = _group_medians(bins, loads)
    _, y, _ = _group_medians(bins, lat)
    return x, y, w


def _fit(loads: FloatArray, lat: FloatArray) -> tuple[FloatArray, FloatArray]:
    """(loads ascending, the non-decreasing least-squares fit of p99 at each)."""
    order = np.argsort(loads, kind="stable")
    y = lat[order]
    fit = y.copy() if y.size < 2 else isotonic_regression(y, increasing=True)
    return loads[order], np.asarray(fit, dtype=np.float64)


def _crossing(loads: FloatArray, lat: FloatArray, sla: float) -> tuple[float, Status]:
    x, fit = _fit(loads, lat)
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


def _estimate_metric(metric: str, loads: FloatArray, lat: FloatArray, sla: float, draws: int,
                     seed: int) -> tuple[str, CapacityEstimate]:
    top = float(loads.max()) if loads.size else 0.0

    def insufficient(reason: str, points: int) -> tuple[str, CapacityEstimate]:
        return metric, CapacityEstimate("insufficient_data", None, None, None, points, top,
                                        f"{metric}: insufficient data: {reason}", metric)

    if loads.size < MIN_POINTS:
        return insufficient(f"{loads.size} observation(s), need {MIN_POINTS}", int(loads.size))
    outliers = _outliers(loads, lat)
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
    x, fitted = _fit(loads, lat)
    expected = np.interp(loads, x, fitted)
    scatter = np.abs(np.log(np.maximum(lat, 1e-9) / np.maximum(expected, 1e-9)))
    if (noisy := float(np.mean(scatter > math.log(OUTLIER_FACTOR)))) > MAX_OUTLIER_SHARE:
        return insufficient(f"too noisy: {noisy:.0%} of the p99s are over {OUTLIER_FACTOR:g}x "
                            f"off the monotone fit", int(loads.size))
    value, status = _crossing(loads, lat, sla)
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(draws):
        pick = rng.integers(0, loads.size, loads.size)
        samples.append(_crossing(loads[pick], lat[pick], sla)[0])
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


def _combine(results: list[tuple[str, CapacityEstimate]]) -> CapacityEstimate:
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


def plot_capacity(model: CapacityModel, path: str | Path, *, sla_ttft_p99_s: float | None = None,
                  sla_itl_p99_s: float | None = None,
                  estimate: CapacityEstimate | None = None) -> Path:
    """Write a PNG: p99 vs load per metric, the monotone fit, the SLA and the capacity band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slas = {"ttft": sla_ttft_p99_s, "itl": sla_itl_p99_s}
    shown = [m for m in METRICS if slas[m] is not None or model.series(m)[0].size]
    fig, axes = plt.subplots(1, max(1, len(shown)), figsize=(6 * max(1, len(shown)), 4),
                             squeeze=False)
    try:
        for ax, metric in zip(axes[0], shown or ["ttft"], strict=False):
            loads, lat = model.series(metric)
            ax.scatter(loads, lat, s=8, alpha=0.4, label="p99 per interval")
            points = model.curve(metric)
            if points:
                ax.plot([p.load_rps for p in points], [p.fitted_p99_s for p in points],
                        color="C1", label="monotone fit")
            if (sla := slas[metric]) is not None:
                ax.axhline(sla, color="C3", ls="--", label=f"SLA {sla:g}s")
            if estimate is not None and estimate.capacity_rps is not None:
                ax.axvline(estimate.capacity_rps, color="k",
                           label=f"capacity {estimate.capacity_rps:.3g} rps ({estimate.status})")
                if estimate.low is not None and estimate.high is not None:
                    ax.axvspan(estimate.low, estimate.high, color="0.5", alpha=0.2, label="band")
            ax.set_xlabel("requests/s per replica")
            ax.set_ylabel(f"{metric} p99 (s)")
            ax.set_title(f"{model.key.label()}: {metric}", fontsize=9)
            ax.legend(fontsize=7)
        out = Path(path)
        fig.tight_layout()
        fig.savefig(out, dpi=90)
    finally:
        plt.close(fig)
    return out
