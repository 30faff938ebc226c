"""Capacity model per (model, engine, engine version, GPU model), learned from live rollups.

Each rollup minute gives one `LoadObservation`: the request rate per ready
replica and the p99 TTFT / ITL over that minute. `CapacityModel` keeps them in
bounded memory (load bins 2% wide on a log scale, the newest `per_bin`
observations in each, so a long quiet week cannot push out the few busy minutes
that show where the engine saturates) and serialises to plain JSON.
Invalid observations (NaN, negative, idle minutes) are refused by `add()` with
the reason and counted.

`estimate()` gives the largest load per replica at which p99 latency stays within
the SLA, with a bootstrap band; the fit, the bounds and `gain(a, b)` (the capacity
ratio a/b with a confidence interval) live in `policies.capacity_fit` and are
re-exported here. `plot_capacity` draws the observations, the fit and the band.
Nothing here raises on data.
"""

from __future__ import annotations

import math
import sys
import zlib
from array import array
from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gearshift.common.errors import InvalidArgument
from gearshift.policies.capacity_fit import (
    BIN_RATIO,
    BOOTSTRAP_DRAWS,
    CapacityEstimate,
    FloatArray,
    GainEstimate,
    Status,
    bin_medians,
    combine,
    estimate_metric,
    gain,
    monotone_fit,
    outlier_mask,
)

SCHEMA_VERSION = 1
PER_BIN = 24                      # newest observations kept per load bin
MAX_BINS = 400                    # bins kept; the emptiest-oldest go first beyond this
SEQ_LIMIT = 2**31 - 1             # bins made are numbered in 32 bits

METRICS = ("ttft", "itl")


@dataclass(frozen=True, slots=True)
class CapacityKey:
    """What a capacity is measured for."""

    model: str
    engine: str
    engine_version: str
    gpu_model: str

    def label(self) -> str:
        return f"{self.model} on {self.engine} {self.engine_version} ({self.gpu_model})"


@dataclass(frozen=True, slots=True)
class LoadObservation:
    """One rollup interval of one deployment; None = the latency was not measured."""

    ts: float
    rps_per_replica: float
    ttft_p99_s: float | None
    itl_p99_s: float | None


@dataclass(frozen=True)
class CurvePoint:
    """One load bin of the fitted curve (for tables and plots)."""

    load_rps: float
    p99_median_s: float
    fitted_p99_s: float
    count: int


FIELDS = 4  # doubles per kept observation: ts, load, ttft p99, itl p99


def _nan_if_none(value: float | None) -> float:
    return math.nan if value is None else value


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else value


_LOG_BIN_RATIO = math.log(BIN_RATIO)


def _bin_of(rps: float) -> int:
    return math.floor(math.log(rps) / _LOG_BIN_RATIO)


def refusal(ts: float, load: float, ttft_p99_s: float | None, itl_p99_s: float | None
            ) -> str | None:
    """Why `CapacityModel.add` refuses an observation with these figures; None: it keeps it."""
    if not math.isfinite(ts):
        return "timestamp not finite"
    if not math.isfinite(load) or load < 0:
        return "load NaN, infinite or negative"
    if load == 0:
        return "idle (no requests)"
    if ttft_p99_s is None and itl_p99_s is None:
        return "no latency measured"
    for value in (ttft_p99_s, itl_p99_s):
        if value is not None and not (math.isfinite(value) and value >= 0):
            return "latency NaN, infinite or negative"
    return None


class CapacityModel:
    """Observations of one `CapacityKey`, in bounded memory, and the estimates from them."""

    __slots__ = ("_bin_ids", "_bin_rows", "_bin_seq", "_count", "_next_seq", "_rows", "accepted",
                 "key", "per_bin", "rejected")

    def __init__(self, key: CapacityKey, *, per_bin: int = PER_BIN) -> None:
        if per_bin < 1:
            raise InvalidArgument(f"capacity model: per_bin must be >= 1, got {per_bin}")
        self.key = key
        self.per_bin = per_bin
        # Per load bin, its newest observations, oldest first, as rows of FIELDS doubles
        # (ts, load, ttft, itl; NaN = not measured, which `add` never keeps as a figure),
        # all in one array, bin after bin (ascending): a fleet holds thousands of models
        # with dozens of bins each, and an array per bin weighed as much as its rows.
        self._rows: array[float] = array("d")
        self._bin_ids: array[int] = array("i")  # the bins kept, ascending (|bin| < 40,000)
        self._bin_rows: array[int] = array("i")  # rows kept in each
        self._bin_seq: array[int] = array("i")  # when each was made (eviction ties: oldest)
        self._next_seq = 0
        self._count = 0  # rows kept, over every bin
        self.accepted = 0
        self.rejected: dict[str, int] = {}

    # --- incremental updates -----------------------------------------------------
    def add(self, obs: LoadObservation) -> str | None:
        """Keep `obs`; returns None, or why it was refused (and counts the refusal)."""
        reason = self._refusal(obs)
        if reason is not None:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1
            return reason
        self._insert(obs.ts, obs.rps_per_replica, _nan_if_none(obs.ttft_p99_s),
                     _nan_if_none(obs.itl_p99_s))
        return None

    def _insert(self, ts: float, load: float, ttft: float, itl: float) -> None:
        """Keep one valid observation (NaN = not measured)."""
        b = _bin_of(load)
        ids = self._bin_ids
        i = bisect_left(ids, b)
        if i == len(ids) or ids[i] != b:
            ids.insert(i, b)
            self._bin_rows.insert(i, 0)
            if self._next_seq == SEQ_LIMIT:  # renumber, keeping the order (2**31 bins made)
                order = sorted(range(len(self._bin_seq)), key=self._bin_seq.__getitem__)
                for rank, j in enumerate(order):
                    self._bin_seq[j] = rank
                self._next_seq = len(order)
            self._bin_seq.insert(i, self._next_seq)
            self._next_seq += 1
        start = sum(self._bin_rows[:i]) * FIELDS
        n = self._bin_rows[i]
        end = start + n * FIELDS
        self._rows[end:end] = array("d", (ts, load, ttft, itl))
        n += 1
        self._count += 1
        if n > self.per_bin:
            del self._rows[start:start + FIELDS]
            n -= 1
            self._count -= 1
        self._bin_rows[i] = n
        self.accepted += 1
        if len(ids) > MAX_BINS:
            self._drop_stalest_bin()

    def extend(self, rows: list[tuple[float, float, float, float]]) -> None:
        """Keep valid observations given as (ts, load, ttft p99, itl p99) rows (NaN = not
        measured; each row must pass `refusal`), in order: the state `add` of each leaves,
        built in one pass over the kept rows instead of one array edit per row (a blind
        backtest adds a step's observation of every model). When the batch could evict a
        bin or renumber the bins, the rows go through `add`'s path one by one."""
        groups: dict[int, list[tuple[float, float, float, float]]] = {}
        floor, log = math.floor, math.log
        for row in rows:
            b = floor(log(row[1]) / _LOG_BIN_RATIO)  # `_bin_of`, inline: every row is binned
            if (group := groups.get(b)) is None:
                groups[b] = [row]
            else:
                group.append(row)
        old = {b: j for j, b in enumerate(self._bin_ids)}
        made = [b for b in groups if b not in old]  # in the order `add` would make them
        if len(old) + len(made) > MAX_BINS or self._next_seq + len(made) > SEQ_LIMIT:
            for row in rows:
                self._insert(*row)
            return
        seq = {b: self._next_seq + j for j, b in enumerate(made)}
        starts = [0] * len(old)
        offset = 0
        for j, n in enumerate(self._bin_rows):
            starts[j] = offset
            offset += n * FIELDS
        rows_out: array[float] = array("d")
        ids_out: array[int] = array("i")
        n_out: array[int] = array("i")
        seq_out: array[int] = array("i")
        for b in sorted(old.keys() | groups.keys()):
            kept: list[float] = []
            if (at := old.get(b)) is not None:
                kept_rows = self._rows[starts[at]:starts[at] + self._bin_rows[at] * FIELDS]
                seq_out.append(self._bin_seq[at])
            else:
                kept_rows = array("d")
                seq_out.append(seq[b])
            for row in groups.get(b, ()):
                kept.extend(row)
            if kept:
                kept_rows.extend(kept)
                del kept_rows[:max(0, len(kept_rows) - self.per_bin * FIELDS)]
            rows_out.extend(kept_rows)
            ids_out.append(b)
            n_out.append(len(kept_rows) // FIELDS)
        self._rows, self._bin_ids, self._bin_rows, self._bin_seq = rows_out, ids_out, n_out, seq_out
        self._next_seq += len(made)
        self._count = len(rows_out) // FIELDS
        self.accepted += len(rows)

    def _drop_stalest_bin(self) -> None:
        """The bin with the fewest observations, then the oldest newest one, goes (the
        first made among equals)."""
        stalest: tuple[tuple[int, float, int], int, int, int] | None = None
        offset = 0
        for j, n in enumerate(self._bin_rows):
            end = offset + n * FIELDS
            key = (n, self._rows[end - FIELDS], self._bin_seq[j])
            if stalest is None or key < stalest[0]:
                stalest = (key, j, offset, end)
            offset = end
        assert stalest is not None
        _, j, start, end = stalest
        del self._rows[start:end]
        self._count -= self._bin_rows[j]
        del self._bin_ids[j]
        del self._bin_rows[j]
        del self._bin_seq[j]

    def add_many(self, observations: Iterable[LoadObservation]) -> int:
        """Add each (as `add` would, one after the other); returns how many were kept."""
        kept = []
        for obs in observations:
            reason = self._refusal(obs)
            if reason is not None:
                self.rejected[reason] = self.rejected.get(reason, 0) + 1
            else:
                kept.append((obs.ts, obs.rps_per_replica, _nan_if_none(obs.ttft_p99_s),
                             _nan_if_none(obs.itl_p99_s)))
        self.extend(kept)
        return len(kept)

    @staticmethod
    def _refusal(obs: LoadObservation) -> str | None:
        return refusal(obs.ts, obs.rps_per_replica, obs.ttft_p99_s, obs.itl_p99_s)

    def observations(self) -> list[LoadObservation]:
        """Every kept observation, by load (oldest first within a load bin)."""
        row = self._rows
        out = []
        for i in range(0, len(row), FIELDS):
            ts, load, ttft, itl = row[i:i + FIELDS]
            out.append(LoadObservation(ts, load, _none_if_nan(ttft), _none_if_nan(itl)))
        return out

    def __len__(self) -> int:
        return self._count

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
        # Engine, version and GPU names repeat across a fleet's models: one string each.
        model = cls(CapacityKey(**{f: sys.intern(key[f]) for f in fields}), per_bin=per_bin)
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
        model._rows = array("d", model._rows)  # loaded: no room kept for growth
        accepted, rejected = data.get("accepted", model.accepted), data.get("rejected", {})
        if isinstance(accepted, int) and not isinstance(accepted, bool):
            model.accepted = max(accepted, model.accepted)
        if isinstance(rejected, dict):
            model.rejected = {str(k): int(v) for k, v in rejected.items()
                              if isinstance(v, int) and not isinstance(v, bool)}
        return model

    # --- estimates -----------------------------------------------------------------
    def series(self, metric: str) -> tuple[FloatArray, FloatArray]:
        """(load, p99 of `metric`) of the observations that measured it, in their order."""
        rows = np.array(self._rows, dtype=np.float64).reshape(-1, FIELDS)
        lat = rows[:, 2 if metric == "ttft" else 3]
        have = ~np.isnan(lat)
        return rows[:, 1][have], lat[have]

    def curve(self, metric: str = "ttft") -> list[CurvePoint]:
        """Per load bin: median load, median p99 and the monotone fit (outliers removed)."""
        _check_metric(metric)
        loads, lat = self.series(metric)
        keep = ~outlier_mask(loads, lat)
        if int(keep.sum()) == 0:
            return []
        x, y, w = bin_medians(loads[keep], lat[keep])
        fitted = np.interp(x, *monotone_fit(loads[keep], lat[keep]))
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
        results = [estimate_metric(metric, *self.series(metric), sla, draws, seed)
                   for metric, sla in slas.items() if sla is not None]
        return combine(results)


def _check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise InvalidArgument(f"unknown latency metric {metric!r}; known: {', '.join(METRICS)}")


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


__all__ = ["MAX_BINS", "METRICS", "PER_BIN", "SCHEMA_VERSION", "CapacityEstimate", "CapacityKey",
           "CapacityModel", "CurvePoint", "GainEstimate", "LoadObservation", "Status", "gain",
           "plot_capacity"]
