"""One model's observations for its signals: request-rate samples and revision times,
and the replica counts the cost rule reads from them (`ModelHistory`).

The rates are numpy arrays: a 28-day backtest reads hundreds of thousands of
windows (its rolling statistics are computed once over the whole series and
cached), and a live tick over 10,000 models counts every model's replicas over
a week of samples. The arithmetic is float64 whatever dtype the rates are
stored in (the live history keeps float32; `controller.rate_history`): each
stored rate is read as the float64 of the same value.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from gearshift.common.frozen_records import fast_init
from gearshift.policies.costmodel import MAX_EXACT_COUNT, REPLICA_EPSILON

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    FloatArray = npt.NDArray[np.float64]
    # Rates: float64, or float32 as the live history keeps them (computed on in float64).
    RateArray = npt.NDArray[np.float64] | npt.NDArray[np.float32]


_RANGES = ("ranges",)  # the cache's key of the window ranges at one `end`
_MEANS = ("means",)  # ... and of the replica means handed over for one request
_REVISIONS = ("revisions",)  # ... of the revision times as floats
_PREFIX_RPS = ("rps",)  # ... of the prefix sums of the rates
_GRID = ("grid",)  # ... of a replay's first sample time and number of samples
_PREFIXES = ("prefixes",)  # ... of the replica prefix sums, by (capacity, headroom, minimum)
PREFIXES_KEPT = 8  # prefix sums kept per history, the last used (a blind backtest learns
                   # a new capacity hundreds of times a run and reads the latest ones)
Window = tuple[int, float]  # (samples, scale) of `ModelHistory.replica_means`


@fast_init
@dataclass(frozen=True)
class ModelHistory:
    """Observations of one model: request-rate samples and revision times (epoch s).

    Arrays may extend past `now`; `compute_signals` only reads what lies before it.
    Rolling statistics over the whole series are computed once and cached (the
    arrays are immutable), so replaying a long trace costs O(1) per window.
    """

    sample_ts: FloatArray  # sorted, one per sample period
    rps: RateArray
    revision_ts: FloatArray  # sorted
    sample_period_s: float
    replay: bool = False  # cache rolling statistics over the whole series (backtests)
    _cache: dict[tuple[object, ...], Any] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def of(sample_ts: list[float] | FloatArray, rps: list[float] | FloatArray,
           revision_ts: list[float] | FloatArray, sample_period_s: float, *,
           replay: bool = False) -> ModelHistory:
        import numpy as np

        ts = np.array(sample_ts, dtype=np.float64)
        values = np.array(rps, dtype=np.float64)
        revisions = np.array(revision_ts, dtype=np.float64)
        if ts.shape != values.shape:
            raise ValueError(f"{ts.size} sample times but {values.size} rates")
        if replay and ts.size > 1 and not np.allclose(np.diff(ts), sample_period_s):
            raise ValueError("replay histories need one sample every sample_period_s")
        for a in (ts, values, revisions):
            a.setflags(write=False)
        return ModelHistory(ts, values, revisions, float(sample_period_s), replay)

    @staticmethod
    def with_ranges(sample_ts: FloatArray, rps: RateArray, revision_ts: FloatArray,
                    sample_period_s: float, end: int,
                    ranges: dict[int, tuple[float, float]]) -> ModelHistory:
        """A history (not a replay) handed its `window_range(end, n)` for each length n of
        `ranges` (n -> (lowest, highest)) as it is made (a live tick makes 10,000 at a
        time, with every model's ranges taken at once: `policies.fleet_signals`)."""
        return ModelHistory(sample_ts, rps, revision_ts, sample_period_s, False,
                            {_RANGES: (end, ranges)})

    def _cached(self, key: tuple[object, ...], make: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def index_before(self, t: float) -> int:
        """Number of samples with timestamp < t."""
        if self.replay:  # a regular grid: arithmetic instead of a search
            if (grid := self._cache.get(_GRID)) is None:  # (a backtest asks at every step)
                size = int(self.sample_ts.size)
                grid = self._cache[_GRID] = (float(self.sample_ts[0]) if size else 0.0, size)
            first, size = grid
            if not size:
                return 0
            i = math.ceil((t - first) / self.sample_period_s - 1e-9)
            return min(max(i, 0), size)
        return int(self.sample_ts.searchsorted(t, side="left"))

    def revision_list(self) -> list[float]:
        if (found := self._cache.get(_REVISIONS)) is None:  # (signals read it at every step)
            found = self._cache[_REVISIONS] = [float(t) for t in self.revision_ts]
        return found  # type: ignore[no-any-return]

    def prefix_rps(self) -> list[float]:
        """prefix[i] = sum of rps[:i]."""
        if (found := self._cache.get(_PREFIX_RPS)) is None:
            import numpy as np

            found = self._cache[_PREFIX_RPS] = np.concatenate(([0.0], np.cumsum(self.rps))).tolist()
        return found  # type: ignore[no-any-return]

    def prefix_replicas(self, capacity_rps: float, headroom: float, min_replicas: int) -> FloatArray:
        """prefix[i] = replicas summed over samples [:i] (docs/cost-model.md `replicas`): a
        float64 array (read with `.item`), the last PREFIXES_KEPT used kept. A blind
        backtest learns a new capacity hundreds of times: an array is 8 bytes a sample where
        a list of floats was 32 (about 190 MB less for bench/blind.py's fleet) and needs no
        conversion, and those no longer read go (bench/blind.py's fleet makes 734 of 64 KB,
        at most 8 a model are kept)."""
        prefixes: dict[tuple[float, float, int], FloatArray] | None = self._cache.get(_PREFIXES)
        if prefixes is None:
            prefixes = self._cache[_PREFIXES] = {}
        key = (capacity_rps, headroom, min_replicas)
        found = prefixes.pop(key, None)  # put back last: the dict runs from least recently used
        if found is None:
            import numpy as np

            n = np.maximum(min_replicas, np.ceil(self.rps * (1 + headroom) / capacity_rps
                                                  - REPLICA_EPSILON))
            found = np.concatenate(([0.0], np.cumsum(n)))
            if len(prefixes) >= PREFIXES_KEPT:
                del prefixes[next(iter(prefixes))]
        prefixes[key] = found
        return found

    def window_range(self, end: int, n: int) -> tuple[float, float]:
        """(lowest, highest) rate of the last n samples before index `end` (1..end). The
        ranges at the last `end` asked are kept: the cost rule asks again for each engine
        the model may move to (a backtest asks at every step: one `end` only)."""
        kept: tuple[int, dict[int, tuple[float, float]]] | None = self._cache.get(_RANGES)
        if kept is None or kept[0] != end:
            kept = self._cache[_RANGES] = (end, {})
        found = kept[1].get(n)
        if found is None:
            rates = self.rps[end - n:end]
            found = kept[1][n] = (float(rates.min()), float(rates.max()))
        return found

    def know_replica_means(self, end: int, headroom: float, min_replicas: int,
                           windows: Sequence[Window], means: Mapping[float, list[float]]) -> None:
        """Hand over `replica_means(end, capacities, headroom, min_replicas, windows)` for
        any of the capacities of `means` (capacity -> a figure per window), computed by the
        caller (`count_replica_means`: many models at once). Only the last hand-over is
        kept."""
        self._cache[_MEANS] = ((end, headroom, min_replicas, tuple(windows)), means)

    def replica_means(self, end: int, capacities: Sequence[float], headroom: float,
                      min_replicas: int, windows: Sequence[tuple[int, float]]) -> list[list[float]]:
        """Mean replicas an engine of each capacity would have needed (`costmodel.replicas`)
        over each window (n, scale): the last n samples before index `end` (1..end), every
        rate multiplied by scale. One row per capacity, one figure per window.

        Windows all end at `end`, so those of one scale are tails of the longest: its replica
        counts are worked out once, for every capacity at once. Replica counts are whole
        numbers, so their sums are exact in any order: every mean is, to the last bit, the
        one a window counted alone gives (and the prefix sums a replay reads). Figures handed
        over for the same request (`know_replica_means`) are read, not counted again."""
        kept: tuple[tuple[object, ...], Mapping[float, list[float]]] | None = self._cache.get(
            _MEANS)
        if kept is not None and kept[0] == (end, headroom, min_replicas, tuple(windows)):
            known = kept[1]
            if all(c in known for c in capacities):
                return [list(known[c]) for c in capacities]
        import numpy as np

        out = [[0.0] * len(windows) for _ in capacities]
        groups: dict[float, list[tuple[int, int]]] = {}  # scale -> its windows (index, n)
        for w, (n, s) in enumerate(windows):
            groups.setdefault(s, []).append((w, n))
        for scale, mine in groups.items():
            if scale == 1.0 and self.replay:  # many windows of one series: prefix sums once
                for row, c in zip(out, capacities, strict=True):
                    at = self.prefix_replicas(c, headroom, min_replicas).item
                    for w, n in mine:
                        row[w] = (at(end) - at(end - n)) / n
                continue
            longest = max([n for _, n in mine])
            # A rate the same number of replicas on an engine at both ends of the window's
            # range needs as many everywhere in it (each step of the count is monotonic): no
            # count per sample (most of a fleet's models sit at their minimum all week).
            lo, hi = self.window_range(end, longest)
            counted = []
            for row, c in zip(out, capacities, strict=True):
                fixed = _replicas(lo, scale, headroom, c, min_replicas)
                if fixed is not None and fixed == _replicas(hi, scale, headroom, c, min_replicas):
                    for w, _ in mine:
                        row[w] = float(fixed)  # fixed * n / n, exactly
                else:
                    counted.append((row, c))
            if not counted:
                continue
            rates = self.rps[end - longest:end]
            # float64 arithmetic, the operations of `costmodel.replicas` in its order, with
            # a row per capacity.
            if scale != 1.0:
                rates = np.multiply(rates, scale, dtype=np.float64)
            need = np.multiply(rates, 1 + headroom, dtype=np.float64)
            need = np.divide(need, np.array([c for _, c in counted], dtype=np.float64)[:, None])
            np.subtract(need, REPLICA_EPSILON, out=need)
            np.ceil(need, out=need)
            np.maximum(need, min_replicas, out=need)
            for w, n in mine:
                sums = np.add.reduce(need[:, longest - n:], axis=1).tolist()
                for (row, _), total in zip(counted, sums, strict=True):
                    row[w] = total / n
        return out

    def rolling(self, width: int, quantile: float) -> tuple[FloatArray, FloatArray]:
        """(max, quantile) of every run of `width` samples; index i covers [i, i + width)."""
        def make() -> tuple[FloatArray, FloatArray]:
            import numpy as np
            from numpy.lib.stride_tricks import sliding_window_view

            rates = np.asarray(self.rps, dtype=np.float64)
            view = sliding_window_view(rates, width)
            if not (0 <= quantile <= 1 and np.isfinite(rates).all()):
                return view.max(axis=1), np.quantile(view, quantile, axis=1)
            return view.max(axis=1), _rolling_quantile(rates.tolist(), width, quantile)
        return self._cached(("rolling", width, quantile), make)  # type: ignore[no-any-return]

    def rolling_lists(self, width: int, quantile: float) -> tuple[list[float], list[float]]:
        """`rolling` as lists of floats (a backtest reads one figure of each per step)."""
        key = ("rolling lists", width, quantile)
        found = self._cache.get(key)
        if found is None:
            peaks, quantiles = self.rolling(width, quantile)
            found = self._cache[key] = (peaks.tolist(), quantiles.tolist())
        return found  # type: ignore[no-any-return]


COUNT_ROWS = 256  # histories counted per numpy pass (`count_replica_means`): bounded memory


def count_replica_means(asks: Sequence[tuple[ModelHistory, int, Sequence[float], float, int,
                                             Sequence[Window]]]) -> None:
    """`ModelHistory.replica_means` for many histories at once, handed over to each
    (`know_replica_means`): each ask is (history, end, capacities, headroom, min_replicas,
    windows), as `replica_means` takes them.

    A replay's windows at scale 1 are read from its prefix sums, as `replica_means` reads
    them. The other windows of a history are grouped by scale, as `replica_means` groups
    them: each group's longest window is counted and the others are its tails. Groups of
    the same window lengths and number of capacities are counted together, `COUNT_ROWS`
    histories per numpy pass (`_count_part`): a capacity whose count is the same at both
    ends of the window's range is that count, as `replica_means` finds it; the others are
    counted a row per (history, capacity), the same elementwise operations on the same
    values as one history's pass, and sums of whole numbers, exact in any order, so
    every figure is the one a history counts alone, to the last bit. A backtest asks this
    of every model at each step (`economics.prepare_estimates`); a live tick counts
    through `window_replica_means` (`policies.fleet_estimates`)."""
    tables = [{c: [0.0] * len(ask[5]) for c in ask[2]} for ask in asks]
    # (longest, lengths, capacities) -> (ask, scale, the windows' indices, as lengths)
    groups: dict[tuple[int, tuple[int, ...], int], list[tuple[int, float, list[int]]]] = {}
    for i, (history, end, capacities, headroom, min_replicas, windows) in enumerate(asks):
        scales: dict[float, list[tuple[int, int]]] = {}
        for w, (n, scale) in enumerate(windows):
            if scale == 1.0 and history.replay:
                for c in capacities:
                    at = history.prefix_replicas(c, headroom, min_replicas).item
                    tables[i][c][w] = (at(end) - at(end - n)) / n
            else:
                scales.setdefault(scale, []).append((w, n))
        for scale, mine in scales.items():
            lengths = tuple(n for _, n in mine)
            groups.setdefault((max(lengths), lengths, len(capacities)), []).append(
                (i, scale, [w for w, _ in mine]))
    for (longest, lengths, _), members in groups.items():
        for first in range(0, len(members), COUNT_ROWS):
            part = members[first:first + COUNT_ROWS]
            picked = [asks[i] for i, _, _ in part]
            _count_part(part, picked, tables, longest, lengths)
    for (history, end, _, headroom, min_replicas, windows), table in zip(asks, tables,
                                                                         strict=True):
        history.know_replica_means(end, headroom, min_replicas, windows, table)


def _count_part(part: list[tuple[int, float, list[int]]],
                picked: list[tuple[ModelHistory, int, Sequence[float], float, int,
                                   Sequence[Window]]],
                tables: list[dict[float, list[float]]], longest: int,
                lengths: tuple[int, ...]) -> None:
    """`count_replica_means` of histories whose windows (at one scale each) have the same
    `lengths` and the same number of capacities: `tables` filled for the windows of `part`
    (ask, scale, the windows' indices)."""
    import numpy as np

    # One array of the windows, and their ranges from it (the minimum and maximum of the
    # same values `window_range` takes one by one): most rows of a backtest are counted.
    rates = cast("RateArray", np.stack([a[0].rps[a[1] - longest:a[1]] for a in picked]))
    ranges = np.stack((rates.min(axis=1), rates.max(axis=1)), axis=1)
    means = window_replica_means(
        rates, [s for _, s, _ in part], [a[3] for a in picked], [a[4] for a in picked],
        [a[2] for a in picked], ranges, lengths).tolist()
    for (i, _, ws), a, figures in zip(part, picked, means, strict=True):
        table = tables[i]
        for c, per_window in zip(a[2], figures, strict=True):
            row = table[c]
            for w, mean in zip(ws, per_window, strict=True):
                row[w] = mean


def window_replica_means(windows: Sequence[RateArray] | RateArray, scales: Sequence[float],
                         headrooms: Sequence[float], min_replicas: Sequence[int],
                         capacities: Sequence[Sequence[float]],
                         ranges: Sequence[tuple[float, float]] | FloatArray,
                         lengths: Sequence[int]) -> FloatArray:
    """Mean replicas of many series at once, as `ModelHistory.replica_means` counts one:
    series k (`windows[k]`, its last `longest` rates, the longest of `lengths`, or row k of
    one 2-D array of them; its (lowest, highest) rate `ranges[k]`) times `scales[k]`, on an engine of each of its
    `capacities[k]` (the same number for every series) with `headrooms[k]` and
    `min_replicas[k]`, over its last n rates for each n of `lengths`: an array (series,
    capacity, length).

    A capacity whose count is the same at both ends of the range (`_replicas`: each step of
    the count is monotonic) needs that count everywhere in it; the others are counted, a
    row per (series, capacity), by the operations of `replica_means` in its order on the
    same values (times a scale of 1 is exact: skipped): every figure is the one the series
    gets alone, to the last bit."""
    import numpy as np

    f64 = np.float64
    longest = max(lengths)
    caps = np.array(capacities, dtype=f64).reshape(len(windows), -1)
    scale = np.array(scales, dtype=f64)[:, None]
    grow = np.add(1, np.array(headrooms, dtype=f64))[:, None]
    least = np.array(min_replicas, dtype=f64)[:, None]
    bounds = np.array(ranges, dtype=f64).reshape(len(windows), 2)
    with np.errstate(all="ignore"):  # not finite: not fixed, counted as one series would be
        lo, hi = (np.subtract(np.multiply(np.multiply(bounds[:, k:k + 1], scale), grow) / caps,
                              REPLICA_EPSILON) for k in (0, 1))
        fixed = (np.isfinite(lo) & np.isfinite(hi) & (lo <= MAX_EXACT_COUNT)
                 & (hi <= MAX_EXACT_COUNT) & (caps > 0))
        lo = np.maximum(least, np.ceil(lo))
        fixed &= lo == np.maximum(least, np.ceil(hi))
    out = np.repeat(lo[:, :, None], len(lengths), axis=2)  # count * n / n, exactly
    rows, cols = np.nonzero(~fixed)
    if rows.size:  # the counted rows alone (most of a fleet's rows are not)
        rates = (windows[rows] if isinstance(windows, np.ndarray)
                 else np.stack([windows[r] for r in rows.tolist()]))
        if (scale != 1.0).any():
            need = np.multiply(rates, scale[rows], dtype=f64)
            np.multiply(need, grow[rows], out=need)
        else:
            need = np.multiply(rates, grow[rows], dtype=f64)
        np.divide(need, caps[rows, cols][:, None], out=need)
        np.subtract(need, REPLICA_EPSILON, out=need)
        np.ceil(need, out=need)
        np.maximum(need, least[rows], out=need)
        for k, n in enumerate(lengths):
            out[rows, cols, k] = np.add.reduce(need[:, longest - n:], axis=1) / n
    return out  # type: ignore[no-any-return]


def _rolling_quantile(rates: list[float], width: int, quantile: float) -> FloatArray:
    """`numpy.quantile` (its default, linear method) of every run of `width` finite rates,
    from one sorted window moved sample by sample instead of a partition per run: the
    same two order statistics, interpolated by numpy's arithmetic (`_lerp`: from the lower
    one below the midpoint, from the upper one at or above it)."""
    import numpy as np

    virtual = (width - 1) * quantile
    below = min(math.floor(virtual), width - 1)
    above = min(below + 1, width - 1)
    gamma = virtual - (below if virtual < width - 1 else -1)  # numpy's index -1 past the end
    ordered = sorted(rates[:width])
    lows, highs = [ordered[below]], [ordered[above]]
    for i in range(width, len(rates)):
        del ordered[bisect_left(ordered, rates[i - width])]
        insort(ordered, rates[i])
        lows.append(ordered[below])
        highs.append(ordered[above])
    low, high = np.array(lows), np.array(highs)
    diff = high - low
    return high - diff * (1 - gamma) if gamma >= 0.5 else low + diff * gamma  # type: ignore[no-any-return]


def _replicas(rate: float, scale: float, headroom: float, capacity: float,
              min_replicas: int) -> int | None:
    """`costmodel.replicas` of one rate times `scale`, by the steps of the arithmetic of
    `ModelHistory.replica_means` (the same IEEE operations on the same values); None where
    that is not a finite count."""
    if not capacity > 0:
        return None
    if scale != 1.0:
        rate = rate * scale
    need = rate * (1 + headroom) / capacity - REPLICA_EPSILON
    if not math.isfinite(need) or need > MAX_EXACT_COUNT:  # (a week of them: sums exact)
        return None
    return max(min_replicas, math.ceil(need))


__all__ = ["COUNT_ROWS", "ModelHistory", "count_replica_means", "window_replica_means"]
