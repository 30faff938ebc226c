"""What the controller learns from the fleet: engine capacity per model, and traffic forecasts.

Capacity models (`gearshift.policies.capacity`) are fed one observation per
completed rollup minute — the request rate per ready replica and the p99
latencies — per (model, engine, engine version, GPU model), and persisted as
JSON settings (`capacity/<label>`) so a restarted controller keeps what it
learned. `live_capacities` turns what was measured into one capacity per engine
for the decision core, by the rule shared with the blind backtest
(`gearshift.policies.priors`): measured figures first, else the policy's priors
or the default ratio, each cited with where it came from and why. A figure is a
measurement only on the release it was measured on: after an engine's upgrade its
earlier release's figure is the new release's prior (``earlier-release``, its band
widened) until the new release has figures of its own.

Forecasts are made again at most every `FORECAST_REFIT_S` per model. Each predicts
from the current history with the trees of the model's previous forecast, refitted
only when due (a week old, the training rows doubled, or the trees no longer fit
the last day: `policies.forecast_model`, the rule the blind backtest follows too),
so most forecasts cost milliseconds and few a fit (tens of milliseconds). The cache
holds each model's latest forecast without its per-bin paths (`decision_forecast`;
the CLI makes its own, with paths): about 10 KB a model with the kept trees, 0.1 GB
at 10,000 models, against about 200 KB with the paths of a 7-day horizon. The live controller makes them on a worker thread
(`ForecastWorker`, at most `FORECAST_WORKER_CPU_SHARE` of a core), stalest first, from
what each tick hands off; without one (tests, tools) a policy tick spends at most
`FORECAST_TICK_BUDGET_S` fitting them (`Forecaster.refresh`). Either way a large
fleet's forecasts are refreshed over several ticks and decisions cite the age of the
one they used. Capacity estimates are cached until their model is observed again. The policy loop asks for the policy's horizon and
sustained quantile, and the forecast enters the savings estimate of its decisions.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from gearshift.common.engine_versions import version_key
from gearshift.common.engines import ENGINE_NAMES
from gearshift.controller.store.database import Store
from gearshift.controller.store.tables import RollupRow
from gearshift.policies.capacity import (
    CapacityEstimate,
    CapacityKey,
    CapacityModel,
    LoadObservation,
)
from gearshift.policies.priors import (
    EngineCapacity,
    Measurement,
    citations,
    resolve_capacities,
)
from gearshift.policies.schema import ModelPriors
from gearshift.policies.signals import CAPACITY_EARLIER, ENGINE_VERSION, RELEASE_TS, SignalValue

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

    from gearshift.policies.forecast import Forecast

log = logging.getLogger(__name__)

SETTING_PREFIX = "capacity/"
# When each engine release was first seen in the fleet (`CapacityLearner.release_seen`),
# stored as `release-seen/<engine>/<version>`: a release newer than a model's choice of
# engine may be trialled (docs/decisions.md, "Engine releases").
RELEASE_SEEN_PREFIX = "release-seen/"
# Releases recorded at most: a fleet runs tens; an agent reporting a new version at every
# report (each 1-64 characters, validated) must not grow memory and the store without end.
# Beyond it a release is not recorded and counts as old (it starts no release trial).
MAX_RELEASES_SEEN = 4096
FORECAST_REFIT_S = 900.0
FORECAST_TICK_BUDGET_S = 0.25  # wall time a policy tick may spend fitting forecasts
# The live controller fits forecasts on a worker thread (`Forecaster(background=True)`),
# not in the tick; it spends at most this share of a core's time (it sleeps between fits).
FORECAST_WORKER_CPU_SHARE = 0.1
FORECAST_HORIZON_S = 24 * 3600.0  # when the caller names none (the policy loop names its own)
FORECAST_QUANTILE = 0.1
FORECAST_MIN_STEP_S = 300.0  # the forecast works on 5-minute bins (or the history's, if coarser)


@dataclass(frozen=True)
class LearnedCapacity:
    key: CapacityKey
    estimate: CapacityEstimate


class CapacityLearner:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.models: dict[CapacityKey, CapacityModel] = {}
        self._dirty: set[CapacityKey] = set()
        # (model, engine) -> its capacity models: `best` runs for every model at every
        # tick, and a scan of the whole fleet's keys made the tick quadratic.
        self._index: dict[tuple[str, str], list[CapacityModel]] = {}
        self._indexed = 0  # len(self.models) when the index was built
        # (key, SLAs) -> (the model's `accepted` count, its estimate without the bootstrap
        # draws): an estimate bootstraps hundreds of fits, and a tick asks again for every
        # model whether or not anything was observed since. An observation kept raises
        # `accepted`, so a changed model is estimated afresh.
        self._estimates: dict[tuple[CapacityKey, float | None, float | None],
                              tuple[int, LearnedCapacity]] = {}
        # "engine/version" -> when the fleet first ran it (epoch s; 0: before anything was
        # recorded), and those not stored yet
        self.releases_seen: dict[str, float] = {}
        self._releases_dirty: set[str] = set()
        self._release_baseline = True  # nothing recorded yet: what runs now is not new
        self._releases_full = False  # MAX_RELEASES_SEEN reached (said once in the log)

    def release_seen(self, engine: str, version: str, now: float) -> float:
        """When `version` of `engine` was first seen in the fleet (recorded now if never),
        0.0 for one that already ran when the controller first recorded releases (its
        first tick on an empty store): only a release that appears later is new."""
        key = f"{engine}/{version}"
        found = self.releases_seen.get(key)
        if found is None:
            if len(self.releases_seen) >= MAX_RELEASES_SEEN:
                if not self._releases_full:
                    log.warning("%d engine releases recorded: %s and later ones are not "
                                "(they count as old)", MAX_RELEASES_SEEN, key)
                    self._releases_full = True
                return 0.0
            found = self.releases_seen[key] = 0.0 if self._release_baseline else now
            self._releases_dirty.add(key)
        return found

    def releases_settled(self) -> None:
        """A tick ended: releases first seen from now on are new (`release_seen`)."""
        self._release_baseline = False

    def load(self) -> None:
        for key, data in self.store.iter_settings_with_prefix(RELEASE_SEEN_PREFIX):
            seen = data.get("first_seen") if isinstance(data, dict) else None
            if isinstance(seen, int | float) and math.isfinite(seen):
                self.releases_seen[key.removeprefix(RELEASE_SEEN_PREFIX)] = float(seen)
            else:
                log.warning("ignoring stored release time %s: %r", key, data)
        self._release_baseline = not self.releases_seen
        for key, data in self.store.iter_settings_with_prefix(SETTING_PREFIX):
            try:
                model = CapacityModel.from_dict(data, where=f"setting {key}")
            except Exception as exc:  # a damaged entry must not stop the controller
                log.warning("ignoring stored capacity model %s: %s", key, exc)
                continue
            self.models[model.key] = model
        # Indexed now, at start-up, not in the first tick (whose garbage it would
        # interleave with: memory the allocator could not give back).
        self._reindex()

    def _reindex(self) -> None:
        self._index = {}
        for key, m in self.models.items():
            self._index.setdefault((key.model, key.engine), []).append(m)
        self._indexed = len(self.models)

    def observe(self, rows: Iterable[RollupRow]) -> int:
        """Feed completed rollup minutes; returns how many observations were kept."""
        kept = 0
        for r in rows:
            if r.replicas <= 0 or r.ttft_p99_s is None:
                continue
            key = CapacityKey(r.model, r.engine, r.engine_version, r.gpu_model)
            model = self.models.setdefault(key, CapacityModel(key))
            obs = LoadObservation(ts=r.minute.timestamp() + 60.0,
                                  rps_per_replica=r.request_rate_mean / r.replicas,
                                  ttft_p99_s=r.ttft_p99_s, itl_p99_s=r.itl_p99_s)
            if model.add(obs) is None:
                kept += 1
                self._dirty.add(key)
        return kept

    def snapshot(self) -> dict[str, Any]:
        """What changed since the last snapshot, ready to store (cheap; on the caller's thread)."""
        out: dict[str, Any] = {f"{SETTING_PREFIX}{key.label()}": self.models[key].to_dict()
                               for key in self._dirty}
        self._dirty.clear()
        seen, self._releases_dirty = self._releases_dirty, set()
        out.update({f"{RELEASE_SEEN_PREFIX}{k}": {"first_seen": self.releases_seen[k]}
                    for k in seen})
        return out

    def save(self) -> None:
        """Store what changed, in one transaction (blocking: run it off the event loop)."""
        self.store.set_settings(self.snapshot())

    def for_model(self, model: str) -> list[CapacityModel]:
        return [m for k, m in sorted(self.models.items(), key=lambda kv: kv[0].label())
                if k.model == model]

    def _of(self, model: str, engine: str, gpu_model: str | None) -> list[CapacityModel]:
        """The capacity models of `model` on `engine` (and GPU; None: any), every release."""
        if self._indexed != len(self.models):
            self._reindex()
        return [m for m in self._index.get((model, engine), ())
                if gpu_model is None or m.key.gpu_model == gpu_model]

    def _estimate(self, chosen: CapacityModel, sla_ttft_p99_s: float | None,
                  sla_itl_p99_s: float | None) -> LearnedCapacity:
        cache_key = (chosen.key, sla_ttft_p99_s, sla_itl_p99_s)
        found = self._estimates.get(cache_key)
        if found is None or found[0] != chosen.accepted:
            estimate = replace(chosen.estimate(sla_ttft_p99_s, sla_itl_p99_s), draws=())
            found = self._estimates[cache_key] = (chosen.accepted, LearnedCapacity(chosen.key,
                                                                                   estimate))
        return found[1]

    def best(self, model: str, engine: str, gpu_model: str | None,
             sla_ttft_p99_s: float | None, sla_itl_p99_s: float | None,
             version: str | None = None) -> LearnedCapacity | None:
        """The estimate from the model with the most points for this engine (and GPU) on
        release `version` of it; None: any release (the engine's release is not known)."""
        if sla_ttft_p99_s is None and sla_itl_p99_s is None:
            return None
        candidates = [m for m in self._of(model, engine, gpu_model)
                      if version is None or m.key.engine_version == version]
        if not candidates:
            return None
        return self._estimate(max(candidates, key=len), sla_ttft_p99_s, sla_itl_p99_s)

    def earlier(self, model: str, engine: str, gpu_model: str | None, version: str,
                sla_ttft_p99_s: float | None, sla_itl_p99_s: float | None
                ) -> LearnedCapacity | None:
        """A usable estimate of another release of `engine` than `version`, for a release
        with none of its own (`live_capacities`): the newest release up to `version` that
        has one, else the oldest after it (a rollback), each release's model with the most
        points; by points where a release cannot be ordered (`release_order`)."""
        if sla_ttft_p99_s is None and sla_itl_p99_s is None:
            return None
        by_release: dict[str, CapacityModel] = {}
        for m in self._of(model, engine, gpu_model):
            v = m.key.engine_version
            if v != version and (v not in by_release or len(m) > len(by_release[v])):
                by_release[v] = m
        if not by_release:
            return None
        order = sorted(by_release, key=lambda v: -len(by_release[v]))
        if (mine := release_order(version)) is not None:
            known = {v: k for v in by_release if (k := release_order(v)) is not None}
            order = (sorted((v for v in known if known[v] <= mine), key=known.__getitem__,
                            reverse=True)
                     + sorted((v for v in known if known[v] > mine), key=known.__getitem__)
                     + [v for v in order if v not in known])
        for v in order:
            learned = self._estimate(by_release[v], sla_ttft_p99_s, sla_itl_p99_s)
            if usable(learned.estimate):
                return learned
        return None


def release_order(version: str) -> tuple[tuple[int, ...], int, int] | None:
    """The sort key of an engine release (`version_key`: 0.11.2 < 0.12.0rc1 < 0.12.0), None
    for a version that is not a release number ("", a build name)."""
    try:
        return version_key(version)
    except ValueError:
        return None


USABLE_STATUSES = ("ok", "lower_bound", "upper_bound")


def usable(est: CapacityEstimate) -> bool:
    """The estimate gives a capacity figure (a measurement, or a measured bound)."""
    return est.status in USABLE_STATUSES and bool(est.capacity_rps)


def _figure(est: CapacityEstimate) -> EngineCapacity:
    return EngineCapacity(est.capacity_rps, est.low, est.high,
                          "measured" if est.status == "ok" else est.status, est.reason)


def measurement(learned: LearnedCapacity | None, engine: str, sla_given: bool,
                version: str | None = None) -> Measurement:
    """What the learner's estimate shows of one engine (on release `version`, where known),
    or why it shows nothing usable."""
    name = f"{engine} {version}" if version else engine
    if not sla_given:
        return Measurement(why=f"{name} not measured: the model has no latency SLA "
                               "(spec.models slaTtftP99Ms / slaItlP99Ms) to measure capacity at",
                           version=version)
    if learned is None:
        return Measurement(why=f"{name} not measured: no latency observed on it yet",
                           version=version)
    est = learned.estimate
    if usable(est):
        return Measurement(_figure(est), version=version)
    return Measurement(why=f"too little data on {name}: {est.reason or est.status}",
                       version=version)


def live_capacities(learner: CapacityLearner | None, model: str, gpu_model: str | None,
                    priors: ModelPriors, versions: Mapping[str, str] | None = None,
                    now: float | None = None
                    ) -> tuple[dict[str, EngineCapacity], dict[str, SignalValue]]:
    """One capacity per engine for `model` (shared rule), and the decision inputs citing them.

    `versions`: the release each engine runs or would run (an engine absent: not known,
    any release's figures count). Only what was measured on that release is a
    measurement; with none, another release's figure is the release's prior
    (`CapacityLearner.earlier`, `priors.earlier_release`), never a measurement. With
    `now`, each known release is cited with when the fleet first ran it
    (`engine_release_ts.<engine>`), and a release measured at the SLA with the figure an
    older one measured (`capacity_earlier.<engine>`: a regression shows against it)."""
    ttft = priors.sla_ttft_p99_ms / 1000 if priors.sla_ttft_p99_ms else None
    itl = priors.sla_itl_p99_ms / 1000 if priors.sla_itl_p99_ms else None
    sla_given = ttft is not None or itl is not None
    versions = versions or {}
    found: dict[str, Measurement] = {}
    points: dict[str, int] = {}
    earlier: dict[str, float | None] = {}
    for e in ENGINE_NAMES:
        version = versions.get(e)
        learned = None if learner is None else learner.best(model, e, gpu_model, ttft, itl,
                                                            version)
        m = found[e] = measurement(learned, e, sla_given, version)
        if version is not None and learner is not None and (
                m.figure is None or (now is not None and m.figure.source == "measured")) and (
                old := learner.earlier(model, e, gpu_model, version, ttft, itl)) is not None:
            if m.figure is None:
                found[e] = replace(m, earlier=_figure(old.estimate),
                                   earlier_version=old.key.engine_version)
            elif _older(old.key.engine_version, version) and old.estimate.status == "ok":
                earlier[e] = old.estimate.capacity_rps
        points[e] = 0 if learned is None else learned.estimate.points
    caps = resolve_capacities(found, priors.engines)
    cite = citations(caps)
    cite.update({f"capacity_points.{e}": n for e, n in points.items()})
    cite.update({f"{ENGINE_VERSION}.{e}": v for e, v in versions.items()})
    if now is not None and learner is not None:
        cite.update({f"{RELEASE_TS}.{e}": learner.release_seen(e, v, now)
                     for e, v in versions.items()})
        cite.update({f"{CAPACITY_EARLIER}.{e}": c for e, c in earlier.items()
                     if c is not None and caps[e].source == "measured"})
    return caps, cite


def _older(a: str, b: str) -> bool:
    """Release `a` comes before release `b` (False where either cannot be ordered)."""
    ka, kb = release_order(a), release_order(b)
    return ka is not None and kb is not None and ka < kb


class Forecaster:
    """Rate forecasts per model, fitted from the history and cached.

    A forecast costs milliseconds, tens of them when its trees are due for a refit, so
    a policy tick never forecasts every model of a large fleet: `refresh` forecasts
    the models whose forecast is missing or older than
    FORECAST_REFIT_S — never-forecast ones first, then the oldest — until
    FORECAST_TICK_BUDGET_S has been spent, and `cached` reads the latest forecast
    without fitting (its age is cited by the decision). A small fleet is refitted
    whole at every tick, as before; a large one cycles through its models.
    """

    def __init__(self, history: Callable[[str], tuple[ArrayLike, ArrayLike]],
                 step_s: float, clock: Callable[[], float] = time.time, *,
                 background: bool = False,
                 worker_cpu_share: float = FORECAST_WORKER_CPU_SHARE) -> None:
        self._history = history  # with `background`, called from the worker thread too
        self._step_s = step_s
        self._clock = clock
        self._cache: dict[str, tuple[float, float, float, Forecast]] = {}
        self.background = background
        self._worker: ForecastWorker | None = None
        self._worker_cpu_share = worker_cpu_share

    def forecast(self, model: str, now: float | None = None, *,
                 horizon_s: float = FORECAST_HORIZON_S,
                 quantile: float = FORECAST_QUANTILE) -> Forecast:
        """The forecast from the samples before `now`, reused for FORECAST_REFIT_S (never
        one made after `now`, which could have seen later samples)."""
        now = self._clock() if now is None else now
        if (fc := self._fresh(model, now, horizon_s, quantile, FORECAST_REFIT_S)) is not None:
            return fc
        return self._fit(model, now, horizon_s, quantile)

    def refresh(self, models: Iterable[str], now: float, *, horizon_s: float,
                quantile: float, budget_s: float = FORECAST_TICK_BUDGET_S) -> int:
        """Fit the stalest of `models` (missing first, then oldest) until `budget_s` of
        wall time is spent (at least one fit when one is due); returns how many."""
        due = [m for m in models if self._fresh(m, now, horizon_s, quantile, FORECAST_REFIT_S) is None]
        due.sort(key=lambda m: self._cache[m][0] if m in self._cache else -math.inf)
        start, fitted = time.perf_counter(), 0
        for model in due:
            if fitted and time.perf_counter() - start >= budget_s:
                break
            self._fit(model, now, horizon_s, quantile)
            fitted += 1
        return fitted

    def hand_off(self, models: Iterable[str], now: float, *, horizon_s: float,
                 quantile: float) -> int:
        """Give the worker thread (started on the first call) the models due for a refit,
        stalest first, to fit from the samples before `now` within its CPU share, while
        the ticks read what is `cached`; a later hand-off replaces what is left of this
        one (the policy loop hands off at the end of each tick). Returns how many were due."""
        due = [m for m in models if self._fresh(m, now, horizon_s, quantile, FORECAST_REFIT_S) is None]
        due.sort(key=lambda m: self._cache[m][0] if m in self._cache else -math.inf)
        if self._worker is None:
            self._worker = ForecastWorker(self._fit, self._worker_cpu_share)
        self._worker.give(due, now, horizon_s, quantile)
        return len(due)

    def hold(self) -> None:
        """Keep the worker from starting another fit until the next `hand_off` (a tick
        runs: the two would share the interpreter)."""
        if self._worker is not None:
            self._worker.hold()

    def close(self) -> None:
        """Stop the worker thread, if one runs (its fit in progress ends first)."""
        if self._worker is not None:
            self._worker.stop()
            self._worker = None

    def worker_stats(self) -> tuple[int, float]:
        """(forecasts the worker fitted, the CPU seconds they took) so far."""
        return (0, 0.0) if self._worker is None else (self._worker.fits, self._worker.fit_cpu_s)

    def cached(self, model: str, now: float, *, horizon_s: float,
               quantile: float) -> Forecast | None:
        """The latest forecast of `model` made at or before `now` for this horizon and
        quantile, whatever its age; None when there is none (nothing is fitted here)."""
        return self._fresh(model, now, horizon_s, quantile, math.inf)

    def _fresh(self, model: str, now: float, horizon_s: float, quantile: float,
               max_age_s: float) -> Forecast | None:
        cached = self._cache.get(model)
        if (cached is not None and cached[1:3] == (horizon_s, quantile)
                and 0.0 <= now - cached[0] < max_age_s):
            return cached[3]
        return None

    def _fit(self, model: str, now: float, horizon_s: float, quantile: float) -> Forecast:
        # scikit-learn and SciPy load with the first fit (a policy asking for a forecast),
        # not with the controller: most of its start-up memory otherwise.
        from gearshift.policies.forecast import decision_forecast

        ts, rps = self._history(model)
        cached = self._cache.get(model)
        fc = decision_forecast(ts, rps, now, horizon_s,
                               step_s=max(self._step_s, FORECAST_MIN_STEP_S), quantile=quantile,
                               kept=None if cached is None else cached[3].model)
        self._cache[model] = (now, horizon_s, quantile, fc)
        return fc


class ForecastWorker:
    """A thread that fits the forecasts a tick handed off (`Forecaster.hand_off`), one at
    a time, sleeping after each fit so that it uses at most `cpu_share` of a core. A
    forecast is stored whole when fitted (one dictionary assignment), so a tick reads
    either the previous forecast or the new one."""

    def __init__(self, fit: Callable[[str, float, float, float], object],
                 cpu_share: float) -> None:
        self._fit = fit
        self._idle_factor = 1.0 / cpu_share - 1.0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._held = threading.Event()  # a tick runs: no new fit until the next job
        self._job: tuple[list[str], float, float, float] | None = None
        self.fits = 0
        self.fit_cpu_s = 0.0
        self._thread = threading.Thread(target=self._run, name="gearshift-forecasts", daemon=True)
        self._thread.start()

    def give(self, models: list[str], now: float, horizon_s: float, quantile: float) -> None:
        with self._lock:
            self._job = (models, now, horizon_s, quantile)
        self._held.clear()
        self._wake.set()

    def hold(self) -> None:
        self._held.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                job, self._job = self._job, None
            if job is None:
                continue
            models, now, horizon_s, quantile = job
            for model in models:
                if self._stopping.is_set() or self._wake.is_set() or self._held.is_set():
                    break  # stopped, a newer job, or a tick runs (its hand-off resumes)
                start = time.thread_time()
                try:
                    self._fit(model, now, horizon_s, quantile)
                except Exception:  # one model's bad history must not stop the others
                    log.exception("forecast of %s failed", model)
                spent = time.thread_time() - start
                self.fits += 1
                self.fit_cpu_s += spent
                self._stopping.wait(spent * self._idle_factor)
