"""Blind backtest: the policy learns engine capacity from simulated latency, as it
would live, instead of reading the trace header's hindsight capacities.

Two halves, kept apart so that the policy path can never read the header's
capacities:

**The world (`LatencyWorld`)** knows the header. Each step it answers with one
observation for the engine that actually serves the model (the other engine is
not observed until it serves, exactly as live): the load per replica and a p99
TTFT drawn from this latency model (per model and engine):

    c      = capacity_rps[e]            (per replica, at the SLA; header)
    n      = replicas(e, r)             (docs/cost-model.md: the fleet is sized on the true capacity)
    rho    = r / (n * c)                (utilisation at the SLA capacity; <= 1/(1+headroom))
    p99(rho) = base_ms * (1 - rho / RHO_SATURATION_RATIO) ** -shape          (M/M/1-like)
    observed = p99(rho) * exp(NOISE_SIGMA * z),   z ~ N(0, 1) per (seed, model, engine, step)

The engine saturates at RHO_SATURATION_RATIO times its SLA capacity; `base_ms`
and `shape` are calibrated so that p99 equals the model's SLA at rho = 1 and the
header's ``ttft_p99_ms[e]`` at the operating load rho_op = 1 / (1 + headroom)
(where the replica formula puts a replica at full use). The curve is increasing
and convex in load. When the header's p99 is not below the SLA (an engine that
breaks it), the shape is SHAPE_MIN_EXPONENT and the curve goes through the
header's p99 at rho_op, so it breaks the SLA at the operating load, as the
header says. The shape is capped at SHAPE_MAX_EXPONENT, and rho_op at
RHO_OPERATING_MAX for a trace without headroom. Idle steps (r = 0) give no
observation. Noise is deterministic for a seed.

**The learner (`BlindLearner`)** sees only what live would: the rates, the
observations of the serving engine, the SLA, sizing, prices and build /
cold-start times (not capacities), and the policy's priors. Per (model, engine)
it feeds a `CapacityModel` and says what it measured; the capacity rule shared
with the live loop (`policies.priors.resolve_capacities`) turns that and the
policy's priors into one capacity per engine with its source:

- ``measured``: `estimate()` found the load where the monotone p99 fit crosses
  the SLA (band = the bootstrap band);
- ``lower_bound``: the SLA was never reached (the usual case: a fleet sized with
  headroom never runs a replica at its SLA capacity), so the figure is the
  highest load served within the SLA; when `estimate()` refuses (too narrow a
  load range) the same figure is taken from the observations themselves. An
  engine never served above its minimum replicas only bounds the capacity;
- under MIN_MEASURED_S of observations (too little data), the rule's priors:
  ``ratio-prior`` (the other engine's figure times the ratio of the policy's
  two priors), ``prior`` (a lone absolute prior), ``default-ratio`` (the other
  engine's figure times `priors.DEFAULT_PRIOR_RATIO`: TensorRT-LLM 5% ahead, the
  middle of the public range of docs/engines.md: vLLM a few % ahead on 8B models to
  TensorRT-LLM +16% on 70B). With nothing measured and no prior, no capacity
  (no move).

So the first move to an unmeasured engine is an engine trial: it happens only
when the prior gain pays for the switch by the policy's margin; afterwards the
measured figures decide (the minimum dwell gives the trial a full day of data).
Lower bounds of both engines come from the same sizing rule, so their ratio is
the engines' ratio.

The rate forecast (`decision_forecast`: sustained q = sustainedQuantile over the
policy horizon) is made once per FORECAST_EVERY_S (FORECAST_RETRY_S while
history is too short for the seasonal model and the forecast is a cheap
fallback), from the samples before that time only, and handed to the
decision core with the signals: its sustained rate is the traffic level of the
savings estimate (`policies.economics`) and every decision cites it, as live.
Each forecast predicts with the trees of the previous one (`kept`), refitted only
when due by the rule the controller's forecasts follow too
(`policies.forecast_model`: a week old, the training rows doubled, or the trees no
longer fit the last day), and
fits its peak model only when a decision cites the peak (`defer_peak`).

Cost: per (model, engine) the capacity estimate is refitted only when the
observations grew by REFIT_GROWTH or REFIT_EVERY_S of serving, and the resolved
capacities are reused while no engine's measurement can have changed (the same
estimate, the same count while under MIN_MEASURED_S). The world makes a (model,
engine)'s loads, replicas and noise for every step with numpy when first asked, and
the readings (`reading`: plain tuples, no objects per step) of the steps asked for from
them; the learner counts each observation and keeps its p99 for the
SLA check as it is handed over, but hands them to the `CapacityModel` in one batch when an
estimate reads it (`CapacityModel.extend`: the state one `add` per observation
leaves), an engine's state key (what its measurement depends on) is worked out once per
observation count, and an engine's facts are made again only when it was observed or its
capacity changed. The backtest hands the learner a model's readings in batches
(`BlindLearner.record`): at each decision, those of the steps since the last batch, and
when another engine starts serving, those of the engine that stops. The learner reads its
observations only at a decision, so each decision sees the state that one reading a step
would leave. On the
30-model, 28-day fleet of `bench/blind.py` the forecasts fit 151 low models (about 5 a
model) instead of 630 and predict from kept trees the other days (docs/cost-model.md has
the runtime).
"""

from __future__ import annotations

import math
import statistics
import zlib
from bisect import bisect_right
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from gearshift.policies.capacity import (
    CapacityEstimate,
    CapacityKey,
    CapacityModel,
    LoadObservation,
    refusal,
)
from gearshift.policies.costmodel import MAX_EXACT_COUNT, REPLICA_EPSILON, replicas
from gearshift.policies.forecast import Forecast, decision_forecast
from gearshift.policies.loader import Policy
from gearshift.policies.priors import (
    EngineCapacity,
    Measurement,
    citations,
    priors_for,
    resolve_capacities,
)
from gearshift.policies.schema import EnginePriors
from gearshift.policies.signals import (
    CAPACITY_EARLIER,
    ENGINE_VERSION,
    LATENCY_SOURCE,
    PRIOR_SOURCE,
    RELEASE_TS,
    EngineFacts,
    ModelFacts,
    ModelHistory,
    SignalValue,
)
from gearshift.policies.trace import ModelProfile, Trace

RHO_SATURATION_RATIO = 1.25   # the engine's saturation rate / its SLA capacity
SHAPE_MIN_EXPONENT = 0.05     # the flattest curve (engines that break the SLA anyway)
SHAPE_MAX_EXPONENT = 8.0      # the steepest (a header p99 far under the SLA near rho = 1)
RHO_OPERATING_MAX = 0.95      # the operating load with (almost) no headroom
NOISE_SIGMA = 0.05            # log-normal sigma of one step's p99
MIN_MEASURED_S = 6 * 3600.0   # observations needed before a measurement replaces the prior
RECENT_P99_S = 3600.0         # the p99 the SLA check sees: median of this much serving
REFIT_GROWTH = 0.25           # re-estimate when observations grew by this share ...
REFIT_EVERY_S = 24 * 3600.0   # ... or when this much new serving time was observed
ESTIMATE_DRAWS = 50           # bootstrap draws per capacity estimate
PER_BIN = 12                  # observations kept per load bin (CapacityModel)
FORECAST_EVERY_S = 24 * 3600.0  # forecast again this often ...
FORECAST_RETRY_S = 3600.0       # ... or this often while it is a fallback (too little history)
BLIND_ENGINE_VERSION = "blind-backtest"
BLIND_GPU_MODEL = "simulated"


# ---- the world ----------------------------------------------------------------------

@dataclass(frozen=True)
class LatencyCurve:
    """p99 TTFT (ms) = base_ms * (1 - rho / RHO_SATURATION_RATIO) ** -shape."""

    base_ms: float
    shape: float

    @staticmethod
    def calibrate(sla_ms: float, operating_ms: float, rho_operating: float) -> LatencyCurve:
        """The curve through (rho_operating, operating_ms) and (1, sla_ms)."""
        if not (0 < rho_operating < 1):
            raise ValueError(f"operating load must be in (0, 1), got {rho_operating}")
        slack_op = 1 - rho_operating / RHO_SATURATION_RATIO
        slack_sla = 1 - 1 / RHO_SATURATION_RATIO
        shape = SHAPE_MIN_EXPONENT
        if operating_ms < sla_ms:
            shape = min(SHAPE_MAX_EXPONENT, max(
                shape, math.log(sla_ms / operating_ms) / math.log(slack_op / slack_sla)))
        return LatencyCurve(operating_ms * slack_op ** shape, shape)

    def p99_ms(self, rho: float) -> float:
        rho = min(max(rho, 0.0), 0.999 * RHO_SATURATION_RATIO)
        return self.base_ms * (1 - rho / RHO_SATURATION_RATIO) ** -self.shape


Reading = tuple[float, float, float, int]  # ts, load per replica, p99 TTFT (s), replicas


@dataclass(frozen=True)
class Observation:
    """One step of one deployment, as the fleet reports it: load and p99, and how many
    replicas were ready (the autoscaler's count, which live reports show too)."""

    load: LoadObservation
    replicas: int


class LatencyWorld:
    """What the simulated fleet would report, from the trace header (hindsight)."""

    def __init__(self, trace: Trace, *, seed: int = 0) -> None:
        self._trace = trace
        self._start_s = trace.start.timestamp()
        rho_op = min(1 / (1 + trace.headroom), RHO_OPERATING_MAX)
        self.curves = {(m, e): LatencyCurve.calibrate(p.sla_ttft_p99_ms, p.ttft_p99_ms[e], rho_op)
                       for m, p in trace.profiles.items() for e in trace.engines}
        # An engine release changes a model's curve from its step on: per era of
        # `Trace.eras`, the curve of the facts then in force (the first is `curves`').
        self._era_curves = {
            (m, e): [LatencyCurve.calibrate(q.sla_ttft_p99_ms, q.ttft_p99_ms[e], rho_op)
                     for q in trace.eras(m)[1]]
            for m in trace.profiles for e in trace.engines}
        self._noise: dict[tuple[str, str], npt.NDArray[np.float64]] = {}
        for m, e in self.curves:
            rng = np.random.default_rng([seed, zlib.crc32(f"{m}/{e}".encode())])
            self._noise[m, e] = np.exp(NOISE_SIGMA * rng.standard_normal(trace.n_steps))
        # (model, engine) -> per step: (observed, load, slack, noise, replicas), made on the
        # first reading asked for
        self._columns: dict[tuple[str, str], npt.NDArray[np.float64]] = {}
        self._breaches: dict[tuple[str, str], list[bool]] = {}

    def breaks_sla(self, model: str, engine: str, k: int) -> bool:
        """Whether step k's reading of `model` on `engine` breaks the TTFT target (idle:
        no), from a column made for every step on the first call."""
        found = self._breaches.get((model, engine))
        if found is None:
            found = self._breaches[model, engine] = self._breach_column(model, engine)
        return found[k]

    def _breach_column(self, model: str, engine: str) -> list[bool]:
        """`breaks_sla` of every step, with numpy (a screen for the learner's own check:
        numpy's power may differ from `readings`' in the last bit)."""
        if (columns := self._columns.get((model, engine))) is None:
            columns = self._columns[model, engine] = self._make_columns(model, engine)
        live, _, slack, noise, _ = columns
        p99 = np.empty(live.shape, dtype=np.float64)
        starts = self._trace.eras(model)[0]
        for i, curve in enumerate(self._era_curves[model, engine]):
            hi = starts[i + 1] if i + 1 < len(starts) else len(p99)
            p99[starts[i]:hi] = curve.base_ms * slack[starts[i]:hi] ** -curve.shape
        sla_ms = self._trace.profiles[model].sla_ttft_p99_ms
        return ((live > 0) & (p99 * noise > sla_ms)).tolist()  # type: ignore[no-any-return]

    def observe(self, model: str, engine: str, k: int) -> Observation | None:
        """Step k's observation of `model` served by `engine`; None when idle."""
        found = self.reading(model, engine, k)
        if found is None:
            return None
        ts, load, p99_s, n = found
        return Observation(LoadObservation(ts, load, p99_s, None), n)

    def reading(self, model: str, engine: str, k: int) -> Reading | None:
        """`observe` as a plain tuple (ts, load per replica, p99 TTFT s, replicas)."""
        return self.readings(model, engine, k, k + 1)[0]

    def readings(self, model: str, engine: str, start: int = 0,
                 stop: int | None = None) -> list[Reading | None]:
        """`reading` of steps [start, stop) (every step by default): the replicas and loads
        of every step made with numpy on the first call for (model, engine) and kept as
        arrays, the readings of the steps asked for made from them (a backtest asks for
        the steps an engine served, once each)."""
        if (columns := self._columns.get((model, engine))) is None:
            columns = self._columns[model, engine] = self._make_columns(model, engine)
        t0, step_s = self._start_s, self._trace.step_s
        starts = self._trace.eras(model)[0]
        stop = columns.shape[1] if stop is None else min(stop, columns.shape[1])
        out: list[Reading | None] = []
        # One run of steps per era of the model's facts (most traces: one).
        for i, curve in enumerate(self._era_curves[model, engine]):
            lo = max(start, starts[i])
            hi = stop if i + 1 == len(starts) else min(stop, starts[i + 1])
            if lo >= hi:
                continue
            live, load, slack, noise, n = columns[:, lo:hi].tolist()
            base, power = curve.base_ms, -curve.shape
            out += [(t0 + k * step_s, x, base * s ** power * z / 1000.0, int(c)) if on else None
                    for k, on, x, s, z, c in zip(range(lo, hi), live, load, slack, noise, n,
                                                 strict=True)]
        return out

    def _make_columns(self, model: str, engine: str) -> npt.NDArray[np.float64]:
        """Per step of `model` on `engine`, as the rows of one (5, steps) array (a batch of
        readings is then one slice): whether it is observed (1.0, else idle: 0.0), the load
        per replica, the slack 1 - rho / RHO_SATURATION_RATIO, the noise and the replicas, with
        numpy (the IEEE operations of `costmodel.replicas` and of r / n, so the same
        figures); `readings` takes the latency curve's power with Python's, as
        `LatencyCurve.p99_ms` takes it. A load `replicas` cannot size raises its error
        here, at the first reading asked for."""
        t, p = self._trace, self._trace.profiles[model]
        r = np.asarray(t.series[model].rps, dtype=np.float64)
        starts, profiles = t.eras(model)
        if len(starts) == 1:
            cap: float | npt.NDArray[np.float64] = p.capacity_rps[engine]
        else:  # the capacity in force at each step (engine releases)
            cap = np.empty(len(r), dtype=np.float64)
            for i, q in enumerate(profiles):
                cap[starts[i]:starts[i + 1] if i + 1 < len(starts) else len(r)] = (
                    q.capacity_rps[engine])
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            needed = r * (1 + t.headroom) / cap - REPLICA_EPSILON
            if (bad := np.flatnonzero((r > 0) & ~(needed <= MAX_EXACT_COUNT))).size:
                at = float(np.broadcast_to(cap, r.shape)[bad[0]])
                replicas(float(r[bad[0]]), at, t.headroom, p.min_replicas)  # raises its error
            n = np.maximum(p.min_replicas, np.ceil(needed))
            live = (r > 0) & (n > 0)
            n = np.where(live, n, 1.0)
            rho = np.minimum(np.maximum(r / (n * cap), 0.0), 0.999 * RHO_SATURATION_RATIO)
            load = r / n
        return np.stack((live, load, 1 - rho / RHO_SATURATION_RATIO, self._noise[model, engine], n))


def blind_view(trace: Trace) -> Trace:
    """The trace as the policy may see it: capacities and latencies hidden (NaN), in the
    header and in engine releases, whose versions (which agents report) stay."""
    nan = dict.fromkeys(trace.engines, math.nan)
    profiles = {m: replace(p, capacity_rps=dict(nan), ttft_p99_ms=dict(nan))
                for m, p in trace.profiles.items()}
    hidden = ("capacity_rps", "ttft_p99_ms")
    series = {m: replace(s, releases=tuple(
                  replace(r, changes={f: v for f, v in r.changes.items() if f not in hidden})
                  for r in s.releases)) if s.releases else s
              for m, s in trace.series.items()}
    return replace(trace, profiles=profiles, series=series)


# ---- the learner ----------------------------------------------------------------------

class _Engine:
    """Observations of one model on one engine, and a cached estimate."""

    def __init__(self, model: str, engine: str, recent_n: int, min_replicas: int) -> None:
        self.min_replicas = min_replicas  # the model's: more replicas is scaling out
        self.model = CapacityModel(CapacityKey(model, engine, BLIND_ENGINE_VERSION, BLIND_GPU_MODEL),
                                   per_bin=PER_BIN)
        self.count = 0
        # Observations not yet in `model`: added in one batch when an estimate reads it.
        self._pending: list[tuple[float, float, float, float]] = []
        self.recent: deque[float] = deque(maxlen=recent_n)  # p99 (ms), last RECENT_P99_S served
        self.scaled_out = False  # ever served by more than the minimum replicas
        self._estimate: CapacityEstimate | None = None
        self.estimated_at = 0  # the observation count of the cached estimate
        self.top_within_sla: float | None = None  # highest load served within the SLA
        self._key: tuple[int | bool, ...] = ()  # `state_key` at the count `_key_count`
        self._key_count = -1
        self._refit_growth = 0.0  # the growth of `count` that makes `estimate` refit
        # (observations, capacity, the engine's facts, latency from the prior) of the
        # last `BlindLearner.facts`
        self.made: tuple[int, EngineCapacity, EngineFacts, bool] | None = None

    def add(self, ts: float, load: float, ttft_s: float | None, itl_s: float | None,
            replicas_n: int, min_replicas: int) -> None:
        """One observation, kept when `CapacityModel.add` would keep it."""
        if refusal(ts, load, ttft_s, itl_s) is None:
            assert ttft_s is not None
            self._pending.append((ts, load, ttft_s, math.nan if itl_s is None else itl_s))
            self.count += 1
            self.scaled_out = self.scaled_out or replicas_n > min_replicas
            self.recent.append(ttft_s * 1000.0)

    def add_readings(self, readings: list[Reading | None]) -> None:
        """`add` of each `LatencyWorld.reading` (a TTFT, no ITL; None: idle, no
        observation), in order: `refusal`'s tests of those figures, inline (a backtest
        hands over a model's readings at each decision, one a step served)."""
        pending, recent, isfinite, nan = self._pending, self.recent, math.isfinite, math.nan
        before = len(pending)
        for reading in readings:
            if reading is None:
                continue
            ts, load, ttft_s, replicas_n = reading
            if isfinite(ts) and isfinite(load) and load > 0 and isfinite(ttft_s) and ttft_s >= 0:
                pending.append((ts, load, ttft_s, nan))
                if replicas_n > self.min_replicas:
                    self.scaled_out = True
                recent.append(ttft_s * 1000.0)
        self.count += len(pending) - before

    def state_key(self, sla_s: float, refit_n: int, min_n: int) -> tuple[int | bool, ...]:
        """What `BlindLearner.measurements` reads of this engine's state: the observation
        count while it is too little data, then which estimate (refitted here when due)
        and whether the engine ever scaled out. Equal keys give equal measurements. The
        same count gives the same key (nothing else moves it): kept for that count."""
        count = self.count
        if self._key_count == count:
            return self._key
        if count < min_n:
            key: tuple[int | bool, ...] = (count,)
        else:
            # `estimate`'s refit test first: no call while the cached estimate stands
            if self._estimate is None or count - self.estimated_at >= self._refit_growth:
                self.estimate(sla_s, refit_n)
            key = (-1, self.estimated_at, self.scaled_out)
            if key == self._key:  # the same key: the same object (a cheaper comparison)
                key = self._key
        self._key, self._key_count = key, count
        return key

    def estimate(self, sla_s: float, refit_n: int) -> CapacityEstimate:
        grown = self.count - self.estimated_at
        if self._estimate is None or grown >= max(1, min(refit_n, REFIT_GROWTH * self.estimated_at)):
            self.model.extend(self._pending)
            self._pending = []
            self._estimate = self.model.estimate(sla_s, draws=ESTIMATE_DRAWS)
            self.estimated_at = self.count
            self._refit_growth = max(1, min(refit_n, REFIT_GROWTH * self.estimated_at))
            loads, p99 = self.model.series("ttft")
            within = loads[p99 <= sla_s]
            self.top_within_sla = float(within.max()) if within.size else None
        return self._estimate


class BlindLearner:
    """Per-model facts for the decision core, learned from observations (no hindsight)."""

    def __init__(self, policy: Policy, view: Trace) -> None:
        self._policy, self._view = policy, view
        recent_n = max(1, math.ceil(RECENT_P99_S / view.step_s))
        self._engines = {(m, e): _Engine(m, e, recent_n, p.min_replicas)
                         for m, p in view.profiles.items() for e in view.engines}
        self._min_n = max(1, math.ceil(MIN_MEASURED_S / view.step_s))
        self._refit_n = max(1, math.ceil(REFIT_EVERY_S / view.step_s))
        self._forecasts: dict[str, tuple[float, Forecast]] = {}  # model -> (made at, forecast)
        # model -> (the engines' state keys, the capacities resolved from them, their citations)
        self._capacities: dict[str, tuple[tuple[tuple[int | bool, ...], ...],
                                          dict[str, EngineCapacity], dict[str, SignalValue]]] = {}
        self._model_priors: dict[str, Mapping[str, EnginePriors]] = {}
        self._cite_keys = {e: (f"{LATENCY_SOURCE}.{e}", f"capacity_points.{e}")
                           for e in view.engines}
        # model -> its SLA (s) and, per engine in the view's order, (engine, its state,
        # its citation keys): what `facts` walks at every step
        self._walk = {m: (p.sla_ttft_p99_ms / 1000.0,
                          [(e, self._engines[m, e], *self._cite_keys[e]) for e in view.engines])
                      for m, p in view.profiles.items()}
        # Engine releases (agents report versions; the view keeps them): per (model, engine)
        # the steps a release starts and its version, and per release seen so far its
        # observations (an `_Engine`), the current one in `_engines`. A release's
        # observations are its own: an earlier release's figure is only its prior.
        self._t0, self._step_s = view.start.timestamp(), view.step_s
        self._releases: dict[tuple[str, str], tuple[list[int], list[str | None]]] = {}
        self._release_ts: dict[tuple[str, str], list[float | None]] = {}
        for m, series in view.series.items():
            for rel in series.releases:
                steps, versions = self._releases.setdefault((m, rel.engine), ([0], [None]))
                stamps = self._release_ts.setdefault((m, rel.engine), [None])
                if rel.step <= steps[-1]:
                    versions[-1], stamps[-1] = rel.version, rel.ts.timestamp()
                else:
                    steps.append(rel.step)
                    versions.append(rel.version)
                    stamps.append(rel.ts.timestamp())
        # (model, engine) -> the capacity its previous release measured, while the current
        # release has its own figure (a regression shows against it)
        self._earlier: dict[tuple[str, str], float] = {}
        self._release_states: dict[tuple[str, str], dict[int, _Engine]] = {}
        self._current: dict[tuple[str, str], int] = {}  # the release index facts are of

    def _state_of(self, model: str, engine: str, i: int) -> _Engine:
        """The observations of release `i` of `engine` for `model`."""
        states = self._release_states.setdefault((model, engine), {})
        if (found := states.get(i)) is None:
            found = states[i] = (self._engines[model, engine] if i == 0 else _Engine(
                model, engine, self._engines[model, engine].recent.maxlen or 1,
                self._view.profiles[model].min_replicas))
        return found

    def record(self, model: str, engine: str, readings: list[Reading | None]) -> None:
        """Add `LatencyWorld.reading`s of `model` served by `engine` (None: an idle step),
        in step order, to that engine's observations (of the release that served each)."""
        if (model, engine) not in self._releases:
            self._engines[model, engine].add_readings(readings)
            return
        steps, _ = self._releases[model, engine]
        run: list[Reading | None] = []
        era = -1
        for reading in readings:
            if reading is None:
                run.append(reading)
                continue
            i = bisect_right(steps, round((reading[0] - self._t0) / self._step_s)) - 1
            if i != era and run:
                self._state_of(model, engine, max(era, 0)).add_readings(run)
                run = []
            era = i
            run.append(reading)
        if run:
            self._state_of(model, engine, max(era, 0)).add_readings(run)

    def _advance(self, model: str, step: int) -> None:
        """Make each engine's current observations those of the release it runs at `step`."""
        changed = False
        for e in self._view.engines:
            if (found := self._releases.get((model, e))) is None:
                continue
            i = bisect_right(found[0], step) - 1
            if self._current.get((model, e), 0) != i:
                self._current[model, e] = i
                changed = True
        if changed:
            sla_s, walk = self._walk[model]
            self._walk[model] = (sla_s, [
                (e, self._state_of(model, e, self._current.get((model, e), 0)), lk, pk)
                for e, _, lk, pk in walk])
            self._capacities.pop(model, None)

    def version(self, model: str, engine: str) -> str | None:
        """The release of `engine` the facts of `model` are of (None: the header's)."""
        found = self._releases.get((model, engine))
        return None if found is None else found[1][self._current.get((model, engine), 0)]

    def measurements(self, model: str) -> dict[str, Measurement]:
        """What the observations of each engine show (nothing read from the header); for
        an engine on a release with no usable figure yet, what its earlier releases
        measured (`Measurement.earlier`)."""
        out: dict[str, Measurement] = {}
        for e, state, _, _ in self._walk[model][1]:
            out[e] = found = self._measure(model, e, state)
            self._earlier.pop((model, e), None)
            if not (i := self._current.get((model, e), 0)):
                continue
            versions = self._releases[model, e][1]
            for j in range(i - 1, -1, -1):  # the latest earlier release with a figure
                old = self._measure(model, e, self._state_of(model, e, j))
                if old.figure is None or old.figure.capacity_rps is None:
                    continue
                if found.figure is None or found.bounds_only:
                    out[e] = replace(found, version=versions[i], earlier=old.figure,
                                     earlier_version=versions[j] or "the first release")
                elif not old.bounds_only:
                    self._earlier[model, e] = old.figure.capacity_rps
                break
        return out

    def _measure(self, model: str, e: str, state: _Engine) -> Measurement:
        """What one release's observations of engine `e` show."""
        sla_s = self._view.profiles[model].sla_ttft_p99_ms / 1000.0
        if state.count < self._min_n:
            return Measurement(why=f"too little data on {e}: {state.count} observation(s), "
                                   f"need {self._min_n} ({MIN_MEASURED_S / 3600:g} h)")
        est = state.estimate(sla_s, self._refit_n)
        if est.status in ("ok", "lower_bound", "upper_bound") and est.capacity_rps:
            source = "measured" if est.status == "ok" else est.status
            found = EngineCapacity(est.capacity_rps, est.low, est.high, source, est.reason)
        elif (top := state.top_within_sla) is not None:
            found = EngineCapacity(top, top, None, "lower_bound",
                                   f"{est.reason}; highest load served within the SLA")
        else:
            return Measurement(why=f"too little data on {e}: {est.reason}")
        if found.source == "lower_bound" and not state.scaled_out:
            # Never scaled out: the load per replica only shows the traffic, not
            # where the fleet had to add replicas; it bounds the capacity, no more.
            return Measurement(replace(found, note=(
                f"{found.note}; never above {self._view.profiles[model].min_replicas} "
                f"replica(s), so it only bounds the capacity")), bounds_only=True)
        return Measurement(found)

    def capacities(self, model: str) -> dict[str, EngineCapacity]:
        """One capacity per engine: the shared rule over what was measured and the priors
        (resolved again only when an engine's measurement can have changed)."""
        return self._resolved(model)[1]

    def _resolved(self, model: str) -> tuple[tuple[tuple[int | bool, ...], ...],
                                             dict[str, EngineCapacity], dict[str, SignalValue]]:
        """(the engines' state keys, the capacities resolved from them, their citations)."""
        sla_s, walk = self._walk[model]
        refit_n, min_n = self._refit_n, self._min_n
        key = tuple([state.state_key(sla_s, refit_n, min_n) for _, state, _, _ in walk])
        cached = self._capacities.get(model)
        if cached is not None and cached[0] == key:
            return cached
        caps = resolve_capacities(self.measurements(model), self._priors(model), self._view.engines)
        cached = self._capacities[model] = (key, caps, citations(caps))
        return cached
    def _priors(self, model: str) -> Mapping[str, EnginePriors]:
        if (found := self._model_priors.get(model)) is None:
            found = self._model_priors[model] = priors_for(self._policy.doc.spec.models,
                                                           model).engines
        return found

    def facts(self, model: str, step: int = 0) -> ModelFacts:
        """Facts for the decision core at `step`, citing where each capacity came from
        (and the engines' releases, where a trace names them)."""
        self._advance(model, step)
        v, p = self._view, self._view.profile_at(model, step)
        _, caps, cited = self._resolved(model)
        cite: dict[str, SignalValue] = dict(cited)
        for e in self._view.engines:
            if (version := self.version(model, e)) is not None:
                cite[f"{ENGINE_VERSION}.{e}"] = version
                cite[f"{RELEASE_TS}.{e}"] = self._release_ts[model, e][
                    self._current.get((model, e), 0)]
                if caps[e].source == "measured" and (model, e) in self._earlier:
                    cite[f"{CAPACITY_EARLIER}.{e}"] = self._earlier[model, e]
        engines = {}
        for e, state, latency_key, points_key in self._walk[model][1]:
            made = state.made
            if made is None or made[0] != state.count or made[1] is not caps[e]:
                # Made again only when the engine was observed or its capacity changed
                # (an engine not serving keeps its figures).
                made = state.made = (state.count, caps[e],
                                     *self._engine_facts_of(model, e, caps[e], p))
            engines[e] = made[2]
            if made[3]:
                cite[latency_key] = PRIOR_SOURCE
            cite[points_key] = state.count
        return ModelFacts(gpus_per_replica=p.gpus_per_replica, min_replicas=p.min_replicas,
                          headroom=v.headroom, overlap_s=v.overlap_s,
                          sla_ttft_p99_ms=p.sla_ttft_p99_ms, engines=engines, nvidia=True,
                          price_per_gpu_hour=v.price_per_gpu_hour, citations=cite)

    def _engine_facts_of(self, model: str, e: str, cap: EngineCapacity, p: ModelProfile
                         ) -> tuple[EngineFacts, bool]:
        """One engine's facts (`p`: the profile in force), and whether its latency is the
        prior's (cited so)."""
        recent = self._state_of(model, e, self._current.get((model, e), 0)).recent
        prior = self._priors(model).get(e)  # type: ignore[call-overload]
        # statistics.median: numpy's figure (the mean of the middle two), without
        # its per-call cost on a dozen values at every step.
        ttft = (float(statistics.median(recent)) if recent
                else prior.ttft_p99_ms if prior is not None else None)
        return (EngineFacts(capacity_rps=cap.capacity_rps, ttft_p99_ms=ttft,
                            cold_start_s=p.cold_start_s[e], build_s=p.build_s[e],
                            build_overhead_usd=p.build_overhead_usd[e]),
                not recent and ttft is not None)

    def forecast(self, model: str, history: ModelHistory, now: float) -> Forecast:
        """The rate forecast, made again from the samples before `now` when the last one is
        FORECAST_EVERY_S old (FORECAST_RETRY_S when it was a fallback), with the last
        one's trees unless they are due for a refit."""
        made = self._forecasts.get(model)
        if made is not None and made[0] <= now:
            age = now - made[0]
            if age < (FORECAST_EVERY_S if made[1].method == "seasonal-gbm" else FORECAST_RETRY_S):
                return made[1]
        end = history.index_before(now)
        spec = self._policy.doc.spec
        fc = decision_forecast(history.sample_ts[:end], history.rps[:end], now, spec.cost.horizon,
                               step_s=history.sample_period_s,
                               quantile=spec.signals.sustained_quantile, defer_peak=True,
                               kept=None if made is None else made[1].model)
        self._forecasts[model] = (now, fc)
        return fc
