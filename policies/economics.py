"""Expected cost of staying versus moving, for one model, from its signals.

The estimate applies the formulas of docs/cost-model.md (`costmodel`) to what was observed:
serving cost is the replica count each engine needs for every rate sample of the
recent past, with the engine's *measured* capacity; a move costs one rebuild of
the target plus the savings forgone while it builds; revision churn costs one
rebuild per revision on whichever engine serves.

The savings rate is the smaller of two figures, each the mean replicas saved
times the price of a replica-hour:

- ``short window``: over the short window's rate samples (`signals.window`),
  scaled to the *traffic level* of the horizon: the forecast sustained rate
  when the signals carry an ``ok`` forecast (the live loop and the blind
  backtest make one, from samples before its origin, over the policy horizon at
  `sustainedQuantile`), else the observed sustained rate (the same quantile over
  the window; scale 1). The samples keep the shape of the traffic (daily cycle,
  bursts, peaks relative to the level), the forecast sets its level: traffic
  expected to fall lowers the estimate, traffic expected to grow raises it.
- ``long window``: over the long window's samples as observed (`signals.longWindow`).

So a short spike (which moves only the short window and not its low quantile),
a stale regime (only the long one) or traffic expected to fall each holds a
move back: a move costs a rebuild. The rebuilds that revisions cause over the
horizon are sized at the window's mean rate scaled to the same level. The
forecast peak is cited, not applied a second time: replicas are sized per
sample (with the headroom), so the window's peaks, scaled to the level, are the
peaks the estimate sizes for. Every estimate says which level it used
(`traffic_basis`, `traffic_level_rps`, `traffic_scale`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from gearshift.common.frozen_records import fast_init
from gearshift.policies.costmodel import SECONDS_PER_HOUR, replicas
from gearshift.policies.signals import EngineFacts, ModelFacts, Signals, count_replica_means

HOURS_PER_WEEK = 168.0
PRICE_LABEL = "gearshift.dev/gpu-price-per-hour"  # host label: USD per GPU-hour on that host
# What a decision, a rule's reason and a policy warning say when no price is known: no
# move can be priced, so the savings rules never move a model.
NO_PRICE_NOTE = (f"no GPU price: set spec.cost.pricePerGpuHour in the policy, the controller's "
                 f"--gpu-price-per-hour ($GEARSHIFT_GPU_PRICE_PER_HOUR) or the host label "
                 f"{PRICE_LABEL}; until then no move can be priced")


@dataclass(frozen=True)
class CostSettings:
    price_per_gpu_hour: float | None  # None: use the fleet's figure from the facts
    build_overhead_usd: dict[str, float]  # per engine, overrides the facts
    horizon_s: float
    hysteresis: float  # required net savings, as a fraction of the switch cost


@fast_init
@dataclass(frozen=True)
class MoveEstimate:
    """Money figures in USD; rates per hour; net over the horizon."""

    target: str
    savings_usd_per_h: float  # serving cost on current minus on target (robust)
    savings_short_usd_per_h: float  # at the traffic level of the horizon (see the module doc)
    savings_long_usd_per_h: float
    switch_usd: float  # one rebuild of the target plus savings forgone while it builds
    churn_usd: float  # extra rebuild cost of revisions on target over the horizon
    net_usd: float  # savings over the horizon - churn - switch
    margin_usd: float  # what net must exceed (hysteresis)
    savings_basis: str = "short window"  # the figure that bound: short window | long window
    # A trial of a new release, estimated at the top of its capacity band: what it assumed
    release_trial: str = ""

    @property
    def worth_it(self) -> bool:
        return self.net_usd > self.margin_usd


def price_of(facts: ModelFacts, cost: CostSettings) -> float | None:
    """USD per GPU-hour: the policy's, else the fleet's (the facts'); None: not known."""
    return cost.price_per_gpu_hour if cost.price_per_gpu_hour is not None else facts.price_per_gpu_hour


def rebuild_estimate_usd(facts: ModelFacts, engine: str, rps: float, price: float,
                         cost: CostSettings) -> float | None:
    """The `rebuild` of docs/cost-model.md on measured facts; None when a fact is missing."""
    ef = facts.engines.get(engine)
    if ef is None or ef.capacity_rps is None or ef.cold_start_s is None:
        return None
    return _rebuild(facts, ef, engine, rps, price, cost)


def _rebuild(facts: ModelFacts, ef: EngineFacts, engine: str, rps: float, price: float,
             cost: CostSettings) -> float:
    """`rebuild_estimate_usd` of `engine`, whose facts `ef` have a capacity and a cold start."""
    assert ef.capacity_rps is not None and ef.cold_start_s is not None
    overhead = cost.build_overhead_usd.get(engine, ef.build_overhead_usd or 0.0)
    n = replicas(rps, ef.capacity_rps, facts.headroom, facts.min_replicas)
    gpus = facts.gpus_per_replica
    gpu_s = (ef.build_s or 0.0) * gpus + (ef.cold_start_s + facts.overlap_s) * n * gpus
    return price * gpu_s / SECONDS_PER_HOUR + overhead


def prepare_estimates(signals: Iterable[Signals]) -> None:
    """Count, for many models at once, the replicas `estimate_move` reads of each model's
    windows, for every engine with a capacity (`signals.count_replica_means`: one numpy
    pass instead of one per model). A backtest step estimates a move for every model of
    its fleet; the estimates then read the figures, the same to the bit. Models whose
    short window is not scaled are left out: a replay reads those counts from prefix
    sums."""
    asks = []
    for sig in signals:
        if sig.rps_current is None or (scale := sig.traffic_scale) == 1.0:
            continue
        facts = sig.facts
        capacities = [c for ef in facts.engines.values()
                      if (c := ef.capacity_rps) is not None and 0 < c < math.inf]
        if len(capacities) > 1:
            asks.append((sig, capacities, facts.headroom, facts.min_replicas,
                         _windows(sig, scale)))
    count_replica_means(asks)


def _windows(sig: Signals, scale: float) -> tuple[tuple[int, float], tuple[int, float]]:
    """The windows of the savings estimate (`estimate_move`): the short one at the traffic
    level, the long one as observed."""
    return ((sig.window_samples, scale), (sig.long_window_samples, 1.0))


def estimate_move(sig: Signals, current: str, target: str, cost: CostSettings, *,
                  target_capacity_rps: float | None = None) -> MoveEstimate | None:
    """Expected net savings of moving `current` -> `target`; None when facts are missing.
    `target_capacity_rps` replaces the target's capacity (a release trial's optimistic
    figure: `policies.core`)."""
    facts = sig.facts
    price = price_of(facts, cost)
    cur, tgt = facts.engines.get(current), facts.engines.get(target)
    if target_capacity_rps is not None and tgt is not None:
        tgt = replace(tgt, capacity_rps=target_capacity_rps)
    # Missing facts first (each would make a rebuild estimate below None): no replicas are
    # counted for an estimate that cannot be made.
    if (price is None or cur is None or tgt is None or cur.capacity_rps is None
            or tgt.capacity_rps is None or sig.rps_current is None
            or cur.cold_start_s is None or tgt.cold_start_s is None):
        return None
    usd_per_replica_h = facts.gpus_per_replica * price
    # Replicas on each engine over the short window, at the horizon's traffic level, and
    # the long one, as observed.
    scale = sig.traffic_scale
    found = sig.replica_means((cur.capacity_rps, tgt.capacity_rps), facts.headroom,
                              facts.min_replicas, _windows(sig, scale))
    if found is None:
        return None
    on_cur, on_tgt = found
    means = [(c - t) * usd_per_replica_h for c, t in zip(on_cur, on_tgt, strict=True)]
    s_short, s_long = means
    basis = "short window" if s_short <= s_long else "long window"
    savings = min(s_short, s_long)
    # Both engines' facts were checked above: `rebuild_estimate_usd` finds every figure.
    rebuild_tgt = _rebuild(facts, tgt, target, sig.rps_current, price, cost)
    horizon_rps = (sig.rps_mean or 0.0) * scale  # revisions land over the horizon
    rebuild_tgt_mean = _rebuild(facts, tgt, target, horizon_rps, price, cost)
    rebuild_cur_mean = _rebuild(facts, cur, current, horizon_rps, price, cost)
    build_h = ((tgt.build_s or 0.0) + (tgt.cold_start_s or 0.0)) / SECONDS_PER_HOUR
    switch = rebuild_tgt + max(savings, 0.0) * build_h
    horizon_h = cost.horizon_s / SECONDS_PER_HOUR
    churn = sig.revisions_per_week * horizon_h / HOURS_PER_WEEK * (rebuild_tgt_mean - rebuild_cur_mean)
    return MoveEstimate(
        target=target, savings_usd_per_h=savings, savings_short_usd_per_h=s_short,
        savings_long_usd_per_h=s_long, switch_usd=switch, churn_usd=churn,
        net_usd=savings * horizon_h - churn - switch, margin_usd=cost.hysteresis * rebuild_tgt,
        savings_basis=basis,
    )
