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
from typing import TYPE_CHECKING, Any, NamedTuple

from gearshift.policies.costmodel import MAX_EXACT_COUNT, REPLICA_EPSILON, SECONDS_PER_HOUR
from gearshift.policies.economics import HOURS_PER_WEEK, CostSettings, MoveEstimate
from gearshift.policies.model_history import COUNT_ROWS, window_replica_means
from gearshift.policies.signals import Signals

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    FloatArray = npt.NDArray[np.float64]

Estimates = dict[str, dict[str, MoveEstimate | None]]  # model -> target -> estimate


class _Row(NamedTuple):
    """A model whose moves are estimated here: its capacities (the current engine's first,
    then each target's) and windows, as `estimate_move` reads them."""

    sig: Signals
    current: str
    scale: float
    price: float
    capacities: list[float]
    short: int  # samples of each window (clipped as `Signals.replica_means` clips them)
    long: int


class _Pair(NamedTuple):
    row: int
    target: str
    column: int  # the target's capacity in its row's


def estimate_fleet_moves(signals: Mapping[str, Signals], engines: Mapping[str, str],
                         cost: CostSettings) -> Estimates:
    """`estimate_move(signals[m], engines[m], t, cost)` for every model m of `engines` (its
    current engine) with signals and every other engine t of its facts, where it is computed
    here (see the module doc); the caller estimates the others itself."""
    out: Estimates = {}
    rows: list[_Row] = []
    pairs: list[_Pair] = []
    fixed = cost.price_per_gpu_hour
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
                targets.append((target, tgt.capacity_rps))
        if not targets:
            continue
        end = sig._end
        short, long = min(sig.window_samples, end), min(sig.long_window_samples, end)
        if short <= 0 or long <= 0:  # `Signals.replica_means` finds no window
            for target, _ in targets:
                mine[target] = None
            continue
        assert cur is not None and cur.capacity_rps is not None and price is not None
        rows.append(_Row(sig, current, sig.traffic_scale, price,
                         [cur.capacity_rps, *(c for _, c in targets)], short, long))
        pairs.extend(_Pair(len(rows) - 1, target, k) for k, (target, _) in
                     enumerate(targets, start=1))
    if pairs:
        _fill(out, rows, pairs, _means(rows), cost)
    return out


def _means(rows: list[_Row]) -> list[list[tuple[float, float]]]:
    """Each row's (short, long) mean replicas on each of its capacities, as
    `Signals.replica_means` counts them for `estimate_move` (`ModelHistory.replica_means`:
    the short window at the row's scale, the long one as observed, both from one count
    when the scale is 1)."""
    # (window lengths, capacities) -> [(row, which)]: which: 2 = both windows, 0 = the
    # short one only, 1 = the long one only
    groups: dict[tuple[tuple[int, ...], int], list[tuple[int, int]]] = {}
    for r, row in enumerate(rows):
        if row.scale == 1.0:
            groups.setdefault(((row.short, row.long), len(row.capacities)), []).append((r, 2))
        else:
            groups.setdefault(((row.short,), len(row.capacities)), []).append((r, 0))
            groups.setdefault(((row.long,), len(row.capacities)), []).append((r, 1))
    shorts: list[list[float]] = [[] for _ in rows]
    longs: list[list[float]] = [[] for _ in rows]
    for (lengths, _), members in groups.items():
        longest = max(lengths)
        for first in range(0, len(members), COUNT_ROWS):
            part = members[first:first + COUNT_ROWS]
            picked = [rows[r] for r, _ in part]
            sigs = [row.sig for row in picked]
            found = window_replica_means(
                [s._history.rps[s._end - longest:s._end] for s in sigs],
                [row.scale if which == 0 else 1.0 for row, (_, which) in
                 zip(picked, part, strict=True)],
                [s.facts.headroom for s in sigs], [s.facts.min_replicas for s in sigs],
                [row.capacities for row in picked],
                [s._history.window_range(s._end, longest) for s in sigs], lengths).tolist()
            for (r, which), per_capacity in zip(part, found, strict=True):
                if which != 1:
                    shorts[r] = [w[0] for w in per_capacity]
                if which != 0:
                    longs[r] = [w[-1] for w in per_capacity]
    return [list(zip(s, lg, strict=True)) for s, lg in zip(shorts, longs, strict=True)]


def _fill(out: Estimates, rows: list[_Row], pairs: list[_Pair],
          means: list[list[tuple[float, float]]], cost: CostSettings) -> None:
    """The estimates of `pairs` from their rows' replica means, by `estimate_move`'s
    formulas (`rebuild_estimate_usd`, `costmodel.replicas`) in their order."""
    import numpy as np

    f64 = np.float64

    def column(values: list[Any]) -> FloatArray:
        return np.array(values, dtype=f64)

    of = [rows[p.row] for p in pairs]
    facts = [row.sig.facts for row in of]
    cur_ef = [f.engines[row.current] for f, row in zip(facts, of, strict=True)]
    tgt_ef = [f.engines[p.target] for f, p in zip(facts, pairs, strict=True)]
    on_cur = [means[p.row][0] for p in pairs]
    on_tgt = [means[p.row][p.column] for p in pairs]
    gpus = column([f.gpus_per_replica for f in facts])
    price = column([row.price for row in of])
    headroom = column([f.headroom for f in facts])
    least = column([f.min_replicas for f in facts])
    overlap = column([f.overlap_s for f in facts])
    rps_now = column([row.sig.rps_current for row in of])
    horizon_rps = column([row.sig.rps_mean or 0.0 for row in of]) * column(
        [row.scale for row in of])
    revisions = column([row.sig.revisions_per_week for row in of])
    overheads = cost.build_overhead_usd
    ok = np.ones(len(pairs), dtype=bool)
    with np.errstate(all="ignore"):
        usd_per_replica_h = gpus * price
        s_short = (column([c[0] for c in on_cur]) - column([t[0] for t in on_tgt])
                   ) * usd_per_replica_h
        s_long = (column([c[1] for c in on_cur]) - column([t[1] for t in on_tgt])
                  ) * usd_per_replica_h
        savings = np.where(s_long < s_short, s_long, s_short)  # min(s_short, s_long)

        def rebuild(rps: FloatArray, efs: list[Any], engines: list[str]) -> FloatArray:
            """`rebuild_estimate_usd`; a count `costmodel.replicas` refuses: left out."""
            needed = rps * (1 + headroom) / column([e.capacity_rps for e in efs]) - (
                REPLICA_EPSILON)
            ok[~(np.isfinite(needed) & (needed <= MAX_EXACT_COUNT))] = False
            n = np.maximum(least, np.ceil(needed))
            gpu_s = column([e.build_s or 0.0 for e in efs]) * gpus + (
                column([e.cold_start_s for e in efs]) + overlap) * n * gpus
            over = column([overheads.get(name, e.build_overhead_usd or 0.0)
                           for name, e in zip(engines, efs, strict=True)])
            return price * gpu_s / SECONDS_PER_HOUR + over  # type: ignore[no-any-return]

        targets = [p.target for p in pairs]
        rebuild_tgt = rebuild(rps_now, tgt_ef, targets)
        rebuild_tgt_mean = rebuild(horizon_rps, tgt_ef, targets)
        rebuild_cur_mean = rebuild(horizon_rps, cur_ef, [row.current for row in of])
        build_h = (column([e.build_s or 0.0 for e in tgt_ef])
                   + column([e.cold_start_s or 0.0 for e in tgt_ef])) / SECONDS_PER_HOUR
        switch = rebuild_tgt + np.where(savings < 0.0, 0.0, savings) * build_h  # max(., 0.0)
        horizon_h = cost.horizon_s / SECONDS_PER_HOUR
        churn = revisions * horizon_h / HOURS_PER_WEEK * (rebuild_tgt_mean - rebuild_cur_mean)
        net = savings * horizon_h - churn - switch
        margin = cost.hysteresis * rebuild_tgt
    for p, row, good, *figures, short_bound in zip(
            pairs, of, ok.tolist(), savings.tolist(), s_short.tolist(), s_long.tolist(),
            switch.tolist(), churn.tolist(), net.tolist(), margin.tolist(),
            (s_short <= s_long).tolist(), strict=True):
        if good:
            out[row.sig.model][p.target] = MoveEstimate(
                p.target, *figures, "short window" if short_bound else "long window")


__all__ = ["Estimates", "estimate_fleet_moves"]
