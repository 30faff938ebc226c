"""What the live policy loop tells the decision core about a model, with citations.

`model_facts` builds a model's `ModelFacts` from its ready deployments: replica
size, GPU model, measured latency (else the policy's priors), capacities by the
rule shared with the blind backtest (`controller.decisions.learning.live_capacities`) on the
release each engine runs or would run (`FactsCache.releases`, cited as
``engine_version.<engine>``), and the results of earlier trials, each figure cited
by its source. `rate_forecasts` gives each model's rate forecast over the policy's
horizon. Both are pure reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

from gearshift.common.engines import ENGINE_NAMES
from gearshift.controller.decisions.gpu_price import host_price, model_price
from gearshift.controller.decisions.learning import live_capacities, release_order
from gearshift.controller.ingest.fleet import FleetState
from gearshift.policies.loader import Policy
from gearshift.policies.priors import EngineCapacity, priors_for
from gearshift.policies.schema import EnginePriors, ModelPriors
from gearshift.policies.signals import (
    LATENCY_SOURCE,
    PRIOR_SOURCE,
    EngineFacts,
    ModelFacts,
    SignalValue,
)
from gearshift.v1 import agent_pb2

if TYPE_CHECKING:
    from gearshift.controller.decisions.learning import CapacityLearner, Forecaster
    from gearshift.policies.forecast import Forecast


NO_PRIORS = ModelPriors()  # a model no `spec.models` entry names (immutable: shared)

class Placement(NamedTuple):
    """A model's hosts' part of its facts (`FactsCache.placement`; its labels shared
    between the models on those hosts: read, never changed)."""

    gpu_model: str | None  # the first of the hosts' GPU models, by name
    nvidia: bool | None
    labels: Mapping[str, str]
    price_per_gpu_hour: float | None
    price_source: str
    # Per catalog engine, the newest release installed on those hosts (None: none says)
    engine_versions: tuple[str | None, ...]


class Releases(NamedTuple):
    """The release each catalog engine runs for a model, or would run after a move
    (`FactsCache.releases`; shared between the models alike: read, never changed)."""

    key: tuple[str | None, ...]  # per catalog engine (None: not known)
    known: Mapping[str, str]     # engine -> release, the known ones


NO_RELEASES = Releases((None,) * len(ENGINE_NAMES), {})


def newest(versions: Iterable[str]) -> str | None:
    """The newest of engine `versions` by release order (`learning.release_order`; a
    version that is not a release number only where there is no other), None: none."""
    best: str | None = None
    best_key = None
    for v in versions:
        if not v:
            continue
        k = release_order(v)
        if best is None or (k is not None and (best_key is None or k > best_key)):
            best, best_key = v, k
    return best


class EnginePlan(NamedTuple):
    """What a model's priors and the policy fix of one engine's facts
    (`FactsCache.engine_plan`)."""

    engine: str
    prior: EnginePriors | None
    build_overhead_usd: float | None
    prior_latency: bool  # the priors give a latency figure (cited when none is measured)


# (model, engine) -> stored result; None in place of one: no model has a trial result
TrialResult = Callable[[str, str], dict[str, Any] | None]


class FactsCache:
    """What one tick's facts share between models, so that it is worked out once: the
    priors of each model under the policy, each host's GPU models and labels, and the
    capacities of models with no latency SLA (those depend on their priors and the
    engines' releases alone: the learner measures capacity at an SLA), the releases of
    the models alike, and each host's GPU price (`controller.decisions.gpu_price`:
    its label, else `gpu_price_per_hour`, the fleet's). Build one per tick (hosts may change
    between ticks) from the tick's policy."""

    def __init__(self, policy: Policy, learner: CapacityLearner | None,
                 gpu_price_per_hour: float | None = None, now: float | None = None) -> None:
        self.policy = policy
        self.learner = learner
        self.gpu_price_per_hour = gpu_price_per_hour
        self.now = now  # the tick's time: releases are cited with when they first ran
        self._prices: dict[str, tuple[float | None, str]] = {}
        self._priors: dict[str, ModelPriors] = {}
        self._hosts: dict[str, tuple[list[str], Mapping[str, str]]] = {}
        self._placements: dict[tuple[str, ...], Placement] = {}
        self._engines: dict[tuple[str, float | None, int], tuple[ModelPriors, EngineFacts]] = {}
        self._unmeasured: dict[tuple[int, tuple[str | None, ...]],
                               tuple[ModelPriors, dict[str, EngineCapacity],
                                     dict[str, SignalValue]]] = {}
        self._releases: dict[tuple[Any, ...], Releases] = {}
        self._fleet_versions: tuple[str | None, ...] | None = None
        self._plans: dict[int, tuple[ModelPriors, tuple[EnginePlan, ...]]] = {}

    def priors(self, model: str) -> ModelPriors:
        found = self._priors.get(model)
        if found is None:
            models = self.policy.doc.spec.models
            found = self._priors[model] = priors_for(models, model) if models else NO_PRIORS
        return found

    def host(self, fleet: FleetState, host_id: str) -> tuple[list[str], Mapping[str, str]]:
        """(GPU models, labels) of a host."""
        found = self._hosts.get(host_id)
        if found is None:
            entry = fleet.hosts[host_id]
            found = self._hosts[host_id] = ([g.model for g in entry.gpus], entry.hello.labels)
        return found

    def price(self, fleet: FleetState, host_id: str) -> tuple[float | None, str]:
        """(USD per GPU-hour, its source) on a host (`controller.decisions.gpu_price.host_price`)."""
        found = self._prices.get(host_id)
        if found is None:
            found = self._prices[host_id] = host_price(self.host(fleet, host_id)[1],
                                                       self.gpu_price_per_hour)
        return found

    def placement(self, fleet: FleetState, host_ids: tuple[str, ...]) -> Placement:
        """What a model's facts take from the hosts of its ready deployments (one host id
        each, in their order): the same for every model on these hosts."""
        found = self._placements.get(host_ids)
        if found is None:
            hosts = [self.host(fleet, h) for h in dict.fromkeys(host_ids)]
            gpu_models = sorted({g for gpus, _ in hosts for g in gpus})
            labels: dict[str, str] = {}
            for h in host_ids:  # in their order: a later host's label wins
                labels.update(self.host(fleet, h)[1])
            price, price_source = model_price([self.price(fleet, h) for h in host_ids])
            found = self._placements[host_ids] = Placement(
                gpu_model=gpu_models[0] if gpu_models else None,
                nvidia=any(m.upper().startswith("NVIDIA") for m in gpu_models)
                if gpu_models else None,
                labels=labels, price_per_gpu_hour=price, price_source=price_source,
                engine_versions=_installed(fleet, dict.fromkeys(host_ids)))
        return found

    def releases(self, fleet: FleetState, placed: Placement,
                 serving: tuple[str, ...]) -> Releases:
        """The release of each engine for a model: what its ready deployments report for
        the engines serving it (`serving`: engine, version, ...: the newest of each
        engine's; "": not known); for the others, the newest installed on its hosts (a
        move's targets go there first: `controller.moves.placement`), else on any host."""
        key = (placed.engine_versions, serving)
        found = self._releases.get(key)
        if found is None:
            versions = list(placed.engine_versions)
            if None in versions:
                if self._fleet_versions is None:
                    self._fleet_versions = _installed(fleet, fleet.hosts)
                versions = [v if v is not None else f
                            for v, f in zip(versions, self._fleet_versions, strict=True)]
            for i in range(0, len(serving), 2):  # a version not reported: not known
                if serving[i] in ENGINE_NAMES:
                    versions[ENGINE_NAMES.index(serving[i])] = serving[i + 1] or None
            found = self._releases[key] = Releases(
                tuple(versions), {e: v for e, v in zip(ENGINE_NAMES, versions, strict=True) if v})
        return found

    def unmeasured_engine(self, engine: str, capacity_rps: float | None, priors: ModelPriors,
                          prior: EnginePriors | None) -> EngineFacts:
        """The facts of an engine nothing was measured on (no latency, no SLA signal): the
        same for every model with these priors and this capacity."""
        key = (engine, capacity_rps, id(priors))
        found = self._engines.get(key)
        if found is None or found[0] is not priors:
            overhead = self.policy.doc.spec.cost.build_overhead_usd.get(engine)  # type: ignore[call-overload]
            found = self._engines[key] = (priors, EngineFacts(**_figures(capacity_rps, prior, overhead)))
        return found[1]

    def engine_plan(self, priors: ModelPriors) -> tuple[EnginePlan, ...]:
        """Each catalog engine's part of a model's facts that its priors and the policy
        fix: the same for every model with these priors."""
        found = self._plans.get(id(priors))
        if found is None or found[0] is not priors:
            overheads = self.policy.doc.spec.cost.build_overhead_usd
            plan = []
            for e in ENGINE_NAMES:
                prior = priors.engines.get(e)  # type: ignore[call-overload]
                plan.append(EnginePlan(
                    e, prior, overheads.get(e),  # type: ignore[call-overload]
                    prior is not None and (prior.ttft_p99_ms is not None
                                           or prior.itl_p99_ms is not None)))
            found = self._plans[id(priors)] = (priors, tuple(plan))
        return found[1]

    def capacities(self, model: str, gpu_model: str | None, priors: ModelPriors,
                   releases: Releases = NO_RELEASES
                   ) -> tuple[dict[str, EngineCapacity], dict[str, SignalValue]]:
        """`live_capacities` on `releases` (the citations shared between models: not to be
        changed)."""
        if priors.sla_ttft_p99_ms or priors.sla_itl_p99_ms:
            return live_capacities(self.learner, model, gpu_model, priors, releases.known,
                                   self.now)
        key = (id(priors), releases.key)
        found = self._unmeasured.get(key)
        if found is None or found[0] is not priors:
            caps, cite = live_capacities(self.learner, model, gpu_model, priors, releases.known,
                                         self.now)
            found = self._unmeasured[key] = (priors, caps, cite)
        return found[1], found[2]


def model_facts(fleet: FleetState, ready: list[tuple[str, agent_pb2.DeploymentReport]],
                model: str, priors: ModelPriors, policy: Policy, learner: CapacityLearner | None,
                trial_result: TrialResult | None, cache: FactsCache | None = None) -> ModelFacts:
    """The facts of `model` from its `ready` (host, deployment) pairs (not empty); `cache`
    shares the tick's work between models (its policy and learner are these);
    `trial_result` None: no model has a trial result (a tick with none asks no model)."""
    cache = cache or FactsCache(policy, learner)
    if len(ready) == 1:  # most models: one ready deployment
        host, d = ready[0]
        host_ids: tuple[str, ...] = (host,)
        gpus_per_replica = priors.gpus_per_replica or (
            d.tensor_parallel_size or len(d.gpu_indices) or 1)
        serving: tuple[str, ...] = (d.engine, d.engine_version)
    else:
        host_ids = tuple(h for h, _ in ready)
        gpus_per_replica = priors.gpus_per_replica or max(
            (d.tensor_parallel_size or len(d.gpu_indices) or 1) for _, d in ready)
        runs: dict[str, list[str]] = {}
        for _, d in ready:
            runs.setdefault(d.engine, []).append(d.engine_version)
        serving = tuple(x for e in sorted(runs) for x in (e, newest(runs[e]) or ""))
    placed = cache.placement(fleet, host_ids)
    measured_ttft: dict[str, float] = {}
    measured_itl: dict[str, float] = {}
    for _, d in ready:
        if d.ttft.present:
            measured_ttft[d.engine] = max(measured_ttft.get(d.engine, 0.0), d.ttft.p99_s * 1000)
        if d.itl.present:
            measured_itl[d.engine] = max(measured_itl.get(d.engine, 0.0), d.itl.p99_s * 1000)
    sla = sla_signals(ready)
    caps, shared_cite = cache.capacities(model, placed.gpu_model, priors,
                                         cache.releases(fleet, placed, serving))
    cite: dict[str, SignalValue] = {}  # the model's own citations, after the shared ones
    engines = {}
    for e, prior, overhead, prior_latency in cache.engine_plan(priors):
        if trial_result is not None and (trial := trial_result(model, e)) is not None:
            cite[f"trial.{e}"] = f"{trial['migration']} {trial['outcome']}: {trial['reason']}"
            for k in ("candidate_ttft_p99_s", "candidate_itl_p99_s"):
                if isinstance(trial.get("figures"), dict) and k in trial["figures"]:
                    cite[f"trial_{k}.{e}"] = trial["figures"][k]
        ttft = measured_ttft.get(e)  # None: not measured
        itl = measured_itl.get(e)
        measured = sla.get(e, NO_SLA_SIGNALS)
        if ttft is None and itl is None:
            if prior_latency:
                cite[f"{LATENCY_SOURCE}.{e}"] = PRIOR_SOURCE
            if measured is NO_SLA_SIGNALS:
                engines[e] = cache.unmeasured_engine(e, caps[e].capacity_rps, priors, prior)
                continue
        figures = _figures(caps[e].capacity_rps, prior, overhead)
        if ttft is not None:
            figures["ttft_p99_ms"] = ttft
        if itl is not None:
            figures["itl_p99_ms"] = itl
        engines[e] = EngineFacts(**figures) if measured is NO_SLA_SIGNALS else replace(
            measured, **figures)
    # Most models add nothing: they share the one dictionary (memory for a large fleet).
    cite = {**shared_cite, **cite} if cite else shared_cite
    return ModelFacts(
        gpus_per_replica=gpus_per_replica, min_replicas=priors.min_replicas, headroom=priors.headroom,
        sla_ttft_p99_ms=priors.sla_ttft_p99_ms, sla_itl_p99_ms=priors.sla_itl_p99_ms, engines=engines,
        nvidia=placed.nvidia, gpu_model=placed.gpu_model, labels=placed.labels,
        price_per_gpu_hour=placed.price_per_gpu_hour, price_source=placed.price_source,
        citations=cite)


def _installed(fleet: FleetState, host_ids: Iterable[str]) -> tuple[str | None, ...]:
    """Per catalog engine, the newest release installed on `host_ids` (None: none)."""
    found: dict[str, list[str]] = {}
    for h in host_ids:
        entry = fleet.hosts.get(h)
        for engine, version in entry.engine_versions if entry is not None else ():
            found.setdefault(engine, []).append(version)
    return tuple(newest(found.get(e, ())) for e in ENGINE_NAMES)


def _figures(capacity_rps: float | None, prior: EnginePriors | None,
             build_overhead_usd: float | None) -> dict[str, Any]:
    """An engine's facts from its capacity and the policy (latency: the priors')."""
    return {"capacity_rps": capacity_rps,
            "ttft_p99_ms": prior.ttft_p99_ms if prior else None,
            "itl_p99_ms": prior.itl_p99_ms if prior else None,
            "cold_start_s": prior.cold_start if prior else None,
            "build_s": prior.build if prior else None,
            "build_overhead_usd": build_overhead_usd}


_ASLEEP = frozenset({agent_pb2.ENGINE_SLEEP_STATE_WEIGHTS_OFFLOADED,
                     agent_pb2.ENGINE_SLEEP_STATE_DISCARD_ALL})
_OPTIONAL = ("preemptions_per_s", "prefix_cache_hit_rate", "mean_prompt_tokens",
             "mean_generation_tokens", "kv_blocks_total", "kv_blocks_used")
NO_SLA_SIGNALS = EngineFacts()  # an engine none of whose reports has an SLA signal


def sla_signals(ready: list[tuple[str, agent_pb2.DeploymentReport]]) -> dict[str, EngineFacts]:
    """Per engine, the SLA signals of its ready deployments' latest reports: queue
    quantiles the worst deployment's (as TTFT), preemptions and KV blocks summed, hit
    rate and request lengths averaged, asleep when any is; None where no report has it
    (`NO_SLA_SIGNALS` where none has any)."""
    by_engine: dict[str, list[agent_pb2.DeploymentReport]] = {}
    for _, d in ready:
        by_engine.setdefault(d.engine, []).append(d)
    out = {}
    for engine, reports in by_engine.items():
        found: dict[str, list[float]] = {}
        queued = []
        known_sleep = []
        for d in reports:
            for name in _OPTIONAL:
                if d.HasField(name):
                    found.setdefault(name, []).append(float(getattr(d, name)))
            if d.queue_time.present:
                queued.append(d.queue_time)
            if d.sleep_state != agent_pb2.ENGINE_SLEEP_STATE_UNSPECIFIED:
                known_sleep.append(d.sleep_state)
        if not found and not queued and not known_sleep:
            out[engine] = NO_SLA_SIGNALS
            continue

        def total(name: str, found: dict[str, list[float]] = found) -> float | None:
            return sum(found[name]) if name in found else None

        def mean(name: str, found: dict[str, list[float]] = found) -> float | None:
            return sum(found[name]) / len(found[name]) if name in found else None

        out[engine] = EngineFacts(
            queue_p50_ms=max(q.p50_s for q in queued) * 1000 if queued else None,
            queue_p99_ms=max(q.p99_s for q in queued) * 1000 if queued else None,
            preemptions_per_s=total("preemptions_per_s"),
            prefix_cache_hit_rate=mean("prefix_cache_hit_rate"),
            asleep=any(s in _ASLEEP for s in known_sleep) if known_sleep else None,
            mean_prompt_tokens=mean("mean_prompt_tokens"),
            mean_generation_tokens=mean("mean_generation_tokens"),
            kv_blocks_total=total("kv_blocks_total"), kv_blocks_used=total("kv_blocks_used"))
    return out


def rate_forecasts(forecaster: Forecaster | None, policy: Policy,
                   now: float) -> Callable[[str], Forecast | None]:
    """A model's latest rate forecast over the policy's horizon at its sustained quantile
    (it sets the traffic level of the savings estimate; `policies.economics`), None until
    one was fitted (`refresh_forecasts`): what the policy and `now` fix looked up once,
    for a tick that asks it of every model."""
    if forecaster is None:
        return lambda model: None
    spec = policy.doc.spec
    cached, horizon_s, quantile = (forecaster.cached, spec.cost.horizon,
                                   spec.signals.sustained_quantile)

    def of(model: str) -> Forecast | None:
        return cached(model, now, horizon_s=horizon_s, quantile=quantile)
    return of


def refresh_forecasts(forecaster: Forecaster | None, models: Iterable[str], policy: Policy,
                      now: float) -> None:
    """At the start of a tick: refit the stalest forecasts within the tick's budget
    (`Forecaster.refresh`); a forecaster with a worker thread is held instead (the tick
    does not wait for fits, nor share the interpreter with them)."""
    if forecaster is None:
        return
    if forecaster.background:
        forecaster.hold()
        return
    spec = policy.doc.spec
    forecaster.refresh(models, now, horizon_s=spec.cost.horizon,
                       quantile=spec.signals.sustained_quantile)


def hand_off_forecasts(forecaster: Forecaster | None, models: Iterable[str], policy: Policy,
                       now: float) -> None:
    """At the end of a tick: the forecasts due for a refit go to the forecaster's worker
    thread, when it has one (`Forecaster.hand_off`)."""
    if forecaster is not None and forecaster.background:
        spec = policy.doc.spec
        forecaster.hand_off(models, now, horizon_s=spec.cost.horizon,
                            quantile=spec.signals.sustained_quantile)
