"""Savings estimates of a whole fleet at once (pure): `estimate_move` of every model and
every engine it may move to, with the arithmetic done by numpy over the fleet.

A live tick estimates a move for each of its models (10,000 at a time); one model at a
time, the figures cost a Python walk through the replica counts of its windows and the
formulas of docs/cost-model.md. Here each figure is computed with the same IEEE
operations in the same order on the same values, on arrays of models
(`model_history.window_replica_means` for the replica counts): every estimate is the
one `estimate_move` gives, to the bit. What this does not compute (a replayed series, a
count the cost model refuses) is left out, and the caller estimates it one model at a
time (`policies.core.decide` does), so it also raises where `estimate_move` would.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gearshift.policies.costmodel import MAX_EXACT_COUNT, REPLICA_EPSILON, SECONDS_PER_HOUR
from gearshift.policies.economics import HOURS_PER_WEEK, CostSettings, MoveEstimate
from gearshift.policies.model_history import COUNT_ROWS, window_replica_means
from gearshift.policies.signals import EngineFacts, Signals

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    FloatArray = npt.NDArray[np.float64]

Estimates = dict[str, dict[str, MoveEstimate | None]]  # model -> target -> estimate


class _Rows:
    """The models whose moves are estimated here, a column per figure `estimate_move`
    reads (a row per model), and their pairs (a row per (model, target))."""

    def __init__(self) -> None:
        self.sigs: list[Signals] = []
        self.scale: list[float] = []
        self.price: list[float] = []
        self.capacities: list[list[float]] = []  # the current engine's first, then targets'
        self.short: list[int] = []  # samples of each window (clipped as
        self.long: list[int] = []  # `Signals.replica_means` clips them)
        self.current: list[EngineFacts] = []
        self.current_overhead: list[float] = []
        # pairs
        self.row: list[int] = []
        self.column: list[int] = []  # the target's capacity in its row's
        self.target: list[str] = []
        self.target_facts: list[EngineFacts] = []
        self.target_overhead: list[float] = []


def estimate_fleet_moves(signals: Mapping[str, Signals], engines: Mapping[str, str],
                         cost: CostSettings) -> Estimates:
    """`estimate_move(signals[m], engines[m], t, cost)` for every model m of `engines` (its
    current engine) with signals and every other engine t of its facts, where it is computed
    here (see the module doc); the caller estimates the others itself."""
    out: Estimates = {}
    rows = _Rows()
    fixed = cost.price_per_gpu_hour
    overheads = cost.build_overhead_usd
    for model, current in engines.items():
        sig = signals.get(model)
        if sig is None or sig.replays:
            continue
        facts = sig.facts
        mine: dict[str, MoveEstimate | None] = {}
        out[model] = mine
        price = fixed if fixed is not None else facts.price_per_gpu_hour
        cur = facts.engines.get(current)
        missing = (price is None or cur is None or cur.capacity_rps is None
                   or sig.rps_current is None or cur.cold_start_s is None)
        targets = []
        for target, tgt in facts.engines.items():
            if target == current:
                continue
            if missing or tgt.capacity_rps is None or tgt.cold_start_s is None:
                mine[target] = None
            else:
                targets.append((target, tgt))
        if not targets:
            continue
        end = sig._end
        short, long = sig.window_samples, sig.long_window_samples
        short, long = (short if short < end else end), (long if long < end else end)
        if short <= 0 or long <= 0:  # `Signals.replica_means` finds no window
            for target, _ in targets:
                mine[target] = None
            continue
        assert cur is not None and price is not None
        r = len(rows.sigs)
        rows.sigs.append(sig)
        rows.scale.append(sig.traffic_scale)
        rows.price.append(price)
        rows.short.append(short)
        rows.long.append(long)
        rows.current.append(cur)
        rows.current_overhead.append(overheads.get(current, cur.build_overhead_usd or 0.0))
        caps = [cur.capacity_rps]
        for k, (target, tgt) in enumerate(targets, start=1):
            caps.append(tgt.capacity_rps)
            rows.row.append(r)
            rows.column.append(k)
            rows.target.append(target)
            rows.target_facts.append(tgt)
            rows.target_overhead.append(overheads.get(target, tgt.build_overhead_usd or 0.0))
        rows.capacities.append(caps)
    if rows.row:
        _fill(out, rows, *_means(rows), cost)
    return out


def _means(rows: _Rows) -> tuple[FloatArray, FloatArray]:
    """Each row's mean replicas on each of its capacities over the short window and over
    the long one (arrays: row, capacity), as `Signals.replica_means` counts them for
    `estimate_move` (`ModelHistory.replica_means`: the short window at the row's scale, the
    long one as observed, both from one count when the scale is 1)."""
    import numpy as np

    # (window lengths, capacities) -> [(row, which)]: which: 2 = both windows, 0 = the
    # short one only, 1 = the long one only
    groups: dict[tuple[tuple[int, ...], int], list[tuple[int, int]]] = {}
    for r, (scale, caps, short, long) in enumerate(zip(rows.scale, rows.capacities, rows.short,
                                                       rows.long, strict=True)):
        if scale == 1.0:
            groups.setdefault(((short, long), len(caps)), []).append((r, 2))
        else:
            groups.setdefault(((short,), len(caps)), []).append((r, 0))
            groups.setdefault(((long,), len(caps)), []).append((r, 1))
    width = max(len(caps) for caps in rows.capacities)
    shorts = np.zeros((len(rows.sigs), width))
    longs = np.zeros((len(rows.sigs), width))
    for (lengths, ncaps), members in groups.items():
        longest = max(lengths)
        for first in range(0, len(members), COUNT_ROWS):
            part = members[first:first + COUNT_ROWS]
            at = [r for r, _ in part]
            sigs = [rows.sigs[r] for r in at]
            found = window_replica_means(
                [s._history.rps[s._end - longest:s._end] for s in sigs],
                [rows.scale[r] if which == 0 else 1.0 for r, which in part],
                [s.facts.headroom for s in sigs], [s.facts.min_replicas for s in sigs],
                [rows.capacities[r] for r in at],
                [s._history.window_range(s._end, longest) for s in sigs], lengths)
            kinds = np.array([which for _, which in part])
            if (short := kinds != 1).any():
                shorts[np.array(at)[short], :ncaps] = found[short, :, 0]
            if (long := kinds != 0).any():
                longs[np.array(at)[long], :ncaps] = found[long, :, -1]
    return shorts, longs


def _fill(out: Estimates, rows: _Rows, shorts: FloatArray, longs: FloatArray,
          cost: CostSettings) -> None:
    """The estimates of `rows`' pairs from their replica means, by `estimate_move`'s
    formulas (`rebuild_estimate_usd`, `costmodel.replicas`) in their order."""
    import numpy as np

    f64 = np.float64

    def column(values: list[Any]) -> FloatArray:
        return np.array(values, dtype=f64)

    at = np.array(rows.row, dtype=np.intp)
    col = np.array(rows.column, dtype=np.intp)
    facts = [s.facts for s in rows.sigs]
    gpus = column([f.gpus_per_replica for f in facts])[at]
    price = column(rows.price)[at]
    headroom = column([f.headroom for f in facts])[at]
    least = column([f.min_replicas for f in facts])[at]
    overlap = column([f.overlap_s for f in facts])[at]
    rps_now = column([s.rps_current for s in rows.sigs])[at]
    horizon_rps = (column([s.rps_mean or 0.0 for s in rows.sigs])
                   * column(rows.scale))[at]
    revisions = column([s.revisions_per_week for s in rows.sigs])[at]
    cur = rows.current
    tgt = rows.target_facts
    cur_cap = column([e.capacity_rps for e in cur])[at]
    cur_cold = column([e.cold_start_s for e in cur])[at]
    cur_build = column([e.build_s or 0.0 for e in cur])[at]
    cur_over = column(rows.current_overhead)[at]
    tgt_cap = column([e.capacity_rps for e in tgt])
    tgt_cold = column([e.cold_start_s for e in tgt])
    tgt_build = column([e.build_s or 0.0 for e in tgt])
    tgt_over = column(rows.target_overhead)
    ok = np.ones(at.size, dtype=bool)
    with np.errstate(all="ignore"):
        usd_per_replica_h = gpus * price
        s_short = (shorts[at, 0] - shorts[at, col]) * usd_per_replica_h
        s_long = (longs[at, 0] - longs[at, col]) * usd_per_replica_h
        savings = np.where(s_long < s_short, s_long, s_short)  # min(s_short, s_long)

        def rebuild(rps: FloatArray, cap: FloatArray, cold: FloatArray, build: FloatArray,
                    over: FloatArray) -> FloatArray:
            """`rebuild_estimate_usd`; a count `costmodel.replicas` refuses: left out."""
            needed = rps * (1 + headroom) / cap - REPLICA_EPSILON
            ok[~(np.isfinite(needed) & (needed <= MAX_EXACT_COUNT))] = False
            n = np.maximum(least, np.ceil(needed))
            gpu_s = build * gpus + (cold + overlap) * n * gpus
            return price * gpu_s / SECONDS_PER_HOUR + over  # type: ignore[no-any-return]

        rebuild_tgt = rebuild(rps_now, tgt_cap, tgt_cold, tgt_build, tgt_over)
        rebuild_tgt_mean = rebuild(horizon_rps, tgt_cap, tgt_cold, tgt_build, tgt_over)
        rebuild_cur_mean = rebuild(horizon_rps, cur_cap, cur_cold, cur_build, cur_over)
        build_h = (tgt_build + tgt_cold) / SECONDS_PER_HOUR
        switch = rebuild_tgt + np.where(savings < 0.0, 0.0, savings) * build_h  # max(., 0.0)
        horizon_h = cost.horizon_s / SECONDS_PER_HOUR
        churn = revisions * horizon_h / HOURS_PER_WEEK * (rebuild_tgt_mean - rebuild_cur_mean)
        net = savings * horizon_h - churn - switch
        margin = cost.hysteresis * rebuild_tgt
    sigs = rows.sigs
    for r, target, good, *figures, short_bound in zip(
            rows.row, rows.target, ok.tolist(), savings.tolist(), s_short.tolist(),
            s_long.tolist(), switch.tolist(), churn.tolist(), net.tolist(), margin.tolist(),
            (s_short <= s_long).tolist(), strict=True):
        if good:
            out[sigs[r].model][target] = MoveEstimate(
                target, *figures, "short window" if short_bound else "long window")


__all__ = ["Estimates", "estimate_fleet_moves"]
