"""The cost model of docs/cost-model.md, exactly: replicas, switch delay, rebuild cost, and
the per-step replay of one model that yields GPU-hours, cost, flaps, revision lag
and SLA-violation minutes.

The formulas are shared by the backtest (which applies them to what really
happened) and the decision core (which applies them to its estimates), so the
two can never disagree about what a switch costs.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass

from gearshift.common.errors import InvalidArgument
from gearshift.policies.trace import ModelProfile, Trace

FLAP_WINDOW_S = 24 * 3600
SECONDS_PER_HOUR = 3600.0
REPLICA_EPSILON = 1e-9  # docs/cost-model.md: keeps r*(1+h)/cap == integer from rounding up
# Counts of replicas and GPUs above this are not exact in float64 (2**53), and GPU
# counts per step must fit int64 when summed over a long trace: refused, not wrapped.
MAX_EXACT_COUNT = 2**40


class CostModelError(InvalidArgument):
    """The inputs need figures the cost model cannot compute exactly (an overflow)."""


def replicas(rps: float, capacity_rps: float, headroom: float, min_replicas: int) -> int:
    """Replicas needed for `rps` with `headroom` on an engine serving `capacity_rps` each."""
    needed = rps * (1 + headroom) / capacity_rps - REPLICA_EPSILON
    if not math.isfinite(needed) or needed > MAX_EXACT_COUNT:
        raise CostModelError(f"{rps:g} rps at {capacity_rps:g} rps per replica needs more than "
                             f"{MAX_EXACT_COUNT} replicas: cannot be priced exactly")
    return max(min_replicas, math.ceil(needed))


def delay_steps(build_s: float, cold_start_s: float, step_s: float) -> int:
    """Steps from deciding a (re)build until the new engine serves (at least one)."""
    return max(1, math.ceil((build_s + cold_start_s) / step_s))


def rebuild_usd(p: ModelProfile, engine: str, rps: float, *, price_per_gpu_hour: float,
                headroom: float, overlap_s: float) -> float:
    """One-off cost of building and starting `engine` for the model at `rps` (docs/cost-model.md)."""
    n = replicas(rps, p.capacity_rps[engine], headroom, p.min_replicas)
    gpu_s = p.build_s[engine] * p.gpus_per_replica + (
        p.cold_start_s[engine] + overlap_s) * n * p.gpus_per_replica
    return price_per_gpu_hour * gpu_s / SECONDS_PER_HOUR + p.build_overhead_usd[engine]


@dataclass(frozen=True)
class ModelOutcome:
    """What one model cost over a replay (figures rounded as docs/cost-model.md prints them)."""

    gpu_hours: float
    cost_usd: float
    flaps: int
    revision_lag_h: float
    sla_violation_min: float
    accepted_steps: tuple[int, ...]  # decision steps of the switches that took effect


class ModelReplay:
    """The cost model (docs/cost-model.md) for one model, one step at a time, so a policy
    can act between steps.

    Call `step(k, to)` for k = 0, 1, … in order; `serving_at(k)` / `switching_at(k)`
    describe the model at the start of step k (what a decision at that instant sees).
    """

    def __init__(self, trace: Trace, model: str, *, initial_engine: str | None = None) -> None:
        self._p = p = trace.profiles[model]
        self._rps = trace.series[model].rps
        self._revisions = set(trace.series[model].revision_steps)
        self._step_s = trace.step_s
        self._price, self._headroom, self._overlap = (
            trace.price_per_gpu_hour, trace.headroom, trace.overlap_s)
        # The facts in force at each step (engine releases change them: `Trace.eras`); a
        # rebuild's cost and delay are those of the step it starts.
        self._era_starts, self._era_profiles = trace.eras(model)
        self._delays = [{e: delay_steps(q.build_s[e], q.cold_start_s[e], trace.step_s)
                         for e in q.capacity_rps} for q in self._era_profiles]
        # GPUs per step on each engine, vectorised; numpy does the same IEEE arithmetic
        # as `replicas`, so the figures are identical. (Imported here: the decision core
        # and the policy loader use this module's formulas without numpy.)
        import numpy as np

        rps = np.asarray(self._rps, dtype=np.float64)
        n = len(self._rps)
        bounds = [*self._era_starts[1:], max(n, self._era_starts[-1])]
        self._gpus: dict[str, list[int]] = {}
        self._breaks: dict[str, list[bool]] = {}
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            for e in p.capacity_rps:
                gpus = np.empty(n, dtype=np.float64)
                breaks = np.empty(n, dtype=bool)
                for q, lo, hi in zip(self._era_profiles, self._era_starts, bounds, strict=True):
                    cap = q.capacity_rps[e]
                    gpus[lo:hi] = np.maximum(p.min_replicas, np.ceil(
                        rps[lo:hi] * (1 + trace.headroom) / cap - REPLICA_EPSILON)
                    ) * p.gpus_per_replica
                    breaks[lo:hi] = q.ttft_p99_ms[e] > q.sla_ttft_p99_ms
                worst = float(gpus.max(initial=0.0))
                if not math.isfinite(worst) or worst > MAX_EXACT_COUNT:
                    raise CostModelError(
                        f"model {model!r} on {e}: {worst:g} GPUs at the busiest step (rps up to "
                        f"{float(rps.max(initial=0.0)):g}, "
                        f"{min(q.capacity_rps[e] for q in self._era_profiles):g} rps per "
                        f"replica, {p.gpus_per_replica} GPUs per replica); at most "
                        f"{MAX_EXACT_COUNT} can be priced exactly")
                self._gpus[e] = gpus.astype(np.int64).tolist()
                self._breaks[e] = breaks.tolist()
        self.serving = initial_engine or p.initial_engine
        self.pending: tuple[str, int] | None = None  # (target, ready step)
        self.left_at: dict[str, int] = {}  # engine -> decision step of the switch off it
        self.last_switch_step: int | None = None
        self._one_off_usd = 0.0
        self._gpu_steps = 0  # replica-GPUs summed over steps: exact, times Δ at the end
        self._lag_open = False
        self._lag_steps = 0
        self._sla_steps = 0
        self._flaps = 0
        self._accepted: list[int] = []

    def _era(self, k: int) -> int:
        """The index of the facts in force at step k."""
        starts = self._era_starts
        return 0 if len(starts) == 1 else bisect_right(starts, k) - 1

    def profile_at(self, k: int) -> ModelProfile:
        """The model's facts in force at step k."""
        return self._era_profiles[self._era(k)]

    def _delay(self, engine: str, k: int) -> int:
        return self._delays[self._era(k)][engine]

    def serving_at(self, k: int) -> str:
        if self.pending is not None and k >= self.pending[1]:
            return self.pending[0]
        return self.serving

    def switching_at(self, k: int) -> str | None:
        """The engine a switch in flight at step k goes to (None: no switch in flight)."""
        if self.pending is None or k >= self.pending[1] or self.pending[0] == self.serving:
            return None
        return self.pending[0]

    def _rebuild(self, engine: str, r: float, k: int) -> float:
        return rebuild_usd(self.profile_at(k), engine, r, price_per_gpu_hour=self._price,
                           headroom=self._headroom, overlap_s=self._overlap)

    def step(self, k: int, to: str | None = None) -> bool:
        """Replay step k with an optional switch decided at k; True when it was accepted."""
        r = self._rps[k]
        if self.pending is not None and k >= self.pending[1]:
            self.serving, self.pending, self._lag_open = self.pending[0], None, False
        if k in self._revisions:
            target = self.pending[0] if self.pending is not None else self.serving
            self._one_off_usd += self._rebuild(target, r, k)
            self.pending = (target, k + self._delay(target, k))
            self._lag_open = True
        accepted = (to is not None and to != self.serving
                    and not (self.pending is not None and self.pending[0] != self.serving))
        if accepted:
            assert to is not None
            self._one_off_usd += self._rebuild(to, r, k)
            self.pending = (to, k + self._delay(to, k))
            if to in self.left_at and (k - self.left_at[to]) * self._step_s < FLAP_WINDOW_S:
                self._flaps += 1
            self.left_at[self.serving] = k
            self.last_switch_step = k
            self._accepted.append(k)
        self._gpu_steps += self._gpus[self.serving][k]
        if self._breaks[self.serving][k]:
            self._sla_steps += 1
        if self._lag_open:
            self._lag_steps += 1
        return accepted

    def steps_unswitched(self, n: int) -> None:
        """`step(k)` for k = 0 .. n-1 of a replay not stepped yet, with no switch decided (a
        static baseline): the same state, summed at once. The engine never changes; each
        revision rebuilds it (priced at its step's rate, in step order) and keeps the
        revision lag open from its step until the rebuild is ready, a later revision
        putting that off."""
        if self._accepted or self.pending is not None or self._gpu_steps or self._lag_steps:
            raise ValueError("steps_unswitched: the replay was already stepped")
        engine = self.serving
        lag_from = lag_to = 0  # the revision lag open over steps [lag_from, lag_to)
        for k in sorted(r for r in self._revisions if 0 <= r < n):
            self._one_off_usd += self._rebuild(engine, self._rps[k], k)
            if k >= lag_to:  # the last rebuild was ready: a new stretch of lag
                self._lag_steps += lag_to - lag_from
                lag_from = k
            lag_to = k + self._delay(engine, k)
        self._lag_steps += min(lag_to, n) - lag_from
        self.pending = (engine, lag_to) if lag_to > n - 1 and lag_to > lag_from else None
        self._lag_open = self.pending is not None
        self._gpu_steps = sum(self._gpus[engine][:n])
        self._sla_steps = sum(self._breaks[engine][:n])

    def outcome(self) -> ModelOutcome:
        gpu_hours = self._gpu_steps * self._step_s / SECONDS_PER_HOUR
        return ModelOutcome(
            gpu_hours=round(gpu_hours, 2),
            cost_usd=round(gpu_hours * self._price + self._one_off_usd, 2),
            flaps=self._flaps,
            revision_lag_h=round(self._lag_steps * self._step_s / SECONDS_PER_HOUR, 2),
            sla_violation_min=round(self._sla_steps * self._step_s / 60, 2),
            accepted_steps=tuple(self._accepted),
        )


def replay_model(trace: Trace, model: str, switches: Mapping[int, str], *,
                 initial_engine: str | None = None) -> ModelOutcome:
    """Apply the cost model (docs/cost-model.md) to `model` with the switch decisions
    `switches` (step -> target).

    `initial_engine` overrides the profile's (the static TensorRT-LLM baseline starts
    there at no cost).
    """
    sim = ModelReplay(trace, model, initial_engine=initial_engine)
    if not switches:
        sim.steps_unswitched(len(trace.series[model].rps))
        return sim.outcome()
    for k in range(len(trace.series[model].rps)):
        sim.step(k, switches.get(k))
    return sim.outcome()
