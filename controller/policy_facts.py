"""What the live policy loop tells the decision core about a model, with citations.

`model_facts` builds a model's `ModelFacts` from its ready deployments: replica
size, GPU model, measured latency (else the policy's priors), capacities by the
rule shared with the blind backtest (`controller.learning.live_capacities`), and
the results of earlier trials, each figure cited by its source. `rate_forecast`
is the rate forecast over the policy's horizon. Both are pure reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from gearshift.common.engines import ENGINE_NAMES
from gearshift.controller.fleet import FleetState
from gearshift.controller.learning import live_capacities
from gearshift.policies.loader import Policy
from gearshift.policies.schema import ModelPriors
from gearshift.policies.signals import EngineFacts, ModelFacts
from gearshift.v1 import agent_pb2

if TYPE_CHECKING:
    from gearshift.controller.learning import CapacityLearner, Forecaster
    from gearshift.policies.forecast import Forecast

ENGINES = ENGINE_NAMES  # the engine catalog's

TrialResult = Callable[[str, str], dict[str, Any] | None]  # (model, engine) -> stored result


def model_facts(fleet: FleetState, ready: list[tuple[str, agent_pb2.DeploymentReport]],
                model: str, priors: ModelPriors, policy: Policy, learner: CapacityLearner | None,
                trial_result: TrialResult) -> ModelFacts:
    """The facts of `model` from its `ready` (host, deployment) pairs (not empty)."""
    gpus_per_replica = priors.gpus_per_replica or max(
        (d.tensor_parallel_size or len(d.gpu_indices) or 1) for _, d in ready)
    gpu_models = sorted({g.model for h, _ in ready for g in fleet.hosts[h].gpus})
    measured_ttft: dict[str, float] = {}
    measured_itl: dict[str, float] = {}
    for _, d in ready:
        if d.ttft.present:
            measured_ttft[d.engine] = max(measured_ttft.get(d.engine, 0.0), d.ttft.p99_s * 1000)
        if d.itl.present:
            measured_itl[d.engine] = max(measured_itl.get(d.engine, 0.0), d.itl.p99_s * 1000)
    caps, cite = live_capacities(learner, model, gpu_models[0] if gpu_models else None,
                                 priors)
    engines = {}
    for e in ENGINES:
        prior = priors.engines.get(e)  # type: ignore[call-overload]
        trial = trial_result(model, e)
        if trial is not None:
            cite[f"trial.{e}"] = f"{trial['migration']} {trial['outcome']}: {trial['reason']}"
            for k in ("candidate_ttft_p99_s", "candidate_itl_p99_s"):
                if isinstance(trial.get("figures"), dict) and k in trial["figures"]:
                    cite[f"trial_{k}.{e}"] = trial["figures"][k]
        engines[e] = EngineFacts(
            capacity_rps=caps[e].capacity_rps,
            ttft_p99_ms=measured_ttft.get(e, prior.ttft_p99_ms if prior else None),
            itl_p99_ms=measured_itl.get(e, prior.itl_p99_ms if prior else None),
            cold_start_s=prior.cold_start if prior else None,
            build_s=prior.build if prior else None,
            build_overhead_usd=policy.doc.spec.cost.build_overhead_usd.get(e))  # type: ignore[call-overload]
    labels: dict[str, str] = {}
    for h, _ in ready:
        labels.update(fleet.hosts[h].hello.labels)
    return ModelFacts(
        gpus_per_replica=gpus_per_replica, min_replicas=priors.min_replicas, headroom=priors.headroom,
        sla_ttft_p99_ms=priors.sla_ttft_p99_ms, sla_itl_p99_ms=priors.sla_itl_p99_ms, engines=engines,
        nvidia=any(m.upper().startswith("NVIDIA") for m in gpu_models) if gpu_models else None,
        gpu_model=gpu_models[0] if gpu_models else None, labels=labels, citations=cite)


def rate_forecast(forecaster: Forecaster | None, model: str, policy: Policy,
                  now: float) -> Forecast | None:
    """The latest rate forecast over the policy's horizon at its sustained quantile (it
    sets the traffic level of the savings estimate; `policies.economics`); None until
    one was fitted (`refresh_forecasts`)."""
    if forecaster is None:
        return None
    spec = policy.doc.spec
    return forecaster.cached(model, now, horizon_s=spec.cost.horizon,
                             quantile=spec.signals.sustained_quantile)


def refresh_forecasts(forecaster: Forecaster | None, models: Iterable[str], policy: Policy,
                      now: float) -> None:
    """Refit the stalest forecasts within the tick's budget (`Forecaster.refresh`)."""
    if forecaster is not None:
        spec = policy.doc.spec
        forecaster.refresh(models, now, horizon_s=spec.cost.horizon,
                           quantile=spec.signals.sustained_quantile)
