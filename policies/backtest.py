"""Replay a trace (docs/cost-model.md, trace format) through the decision core on a
simulated clock and price the outcome with the cost model (docs/cost-model.md).

At the start of every evaluation step the backtest computes each model's signals
from the samples before that instant, calls `decide`, and feeds the decisions to
`costmodel.ModelReplay`, which applies the delay, rebuilds, flaps and SLA minutes.
Measured facts (capacity, latency, build and cold-start times) come from the trace
header, as the live system would measure them. With ``blind=True`` the policy sees
no header capacity or latency: the simulator answers each step with a latency
observation of the serving engine and the policy learns capacity from them
(`policies.blind`, which documents the latency model) and, as live, forecasts
the rate (the forecast enters the savings estimate); without ``blind`` no
forecast is made and the observed windows decide. The backtest replays what the
policy would do if executed, whatever its `mode`.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Mapping
from typing import Any

import numpy as np

from gearshift.policies.blind import BlindLearner, LatencyWorld, blind_view
from gearshift.policies.core import Decision, ModelState, decide
from gearshift.policies.costmodel import ModelOutcome, ModelReplay, replay_model
from gearshift.policies.economics import prepare_estimates
from gearshift.policies.loader import Policy
from gearshift.policies.model_state import (
    MEASURED_SOURCE,
    SwitchOutcome,
    SwitchRecord,
    Tenure,
    advance_tenure,
    current_engine,
    last_switch,
    release_key,
)
from gearshift.policies.signals import (
    CAPACITY_EARLIER,
    ENGINE_VERSION,
    RELEASE_TS,
    EngineFacts,
    ModelFacts,
    ModelHistory,
    Signals,
    SignalValue,
    breach_is_measured,
    compute_signals,
)
from gearshift.policies.trace import EngineRelease, ModelProfile, Trace, format_ts

LONG_AGO_S = 365 * 86400.0  # models start the trace settled on their initial engine


def facts_from_profile(trace: Trace, p: ModelProfile,
                       releases: Mapping[str, tuple[EngineRelease, ModelProfile]] | None = None
                       ) -> ModelFacts:
    """What the live system would have measured for a model, from the trace header (and,
    from a release's step on, from its record: `Trace.profile_at`); `releases`: per engine
    whose release a record named, that record and the facts in force before it."""
    engines = {
        e: EngineFacts(capacity_rps=p.capacity_rps[e], ttft_p99_ms=p.ttft_p99_ms[e],
                       cold_start_s=p.cold_start_s[e], build_s=p.build_s[e],
                       build_overhead_usd=p.build_overhead_usd[e])
        for e in p.capacity_rps
    }
    # The header is what measuring every engine would have found: cite it as measured
    # (so no move of this replay needs a trial first).
    cite: dict[str, SignalValue] = {f"capacity_source.{e}": MEASURED_SOURCE for e in engines}
    for e, (rel, before) in (releases or {}).items():
        cite[f"{ENGINE_VERSION}.{e}"] = rel.version
        cite[f"{RELEASE_TS}.{e}"] = rel.ts.timestamp()
        if before.capacity_rps[e] != p.capacity_rps[e]:
            cite[f"{CAPACITY_EARLIER}.{e}"] = before.capacity_rps[e]
    return ModelFacts(gpus_per_replica=p.gpus_per_replica, min_replicas=p.min_replicas,
                      headroom=trace.headroom, overlap_s=trace.overlap_s,
                      sla_ttft_p99_ms=p.sla_ttft_p99_ms, engines=engines, nvidia=True,
                      price_per_gpu_hour=trace.price_per_gpu_hour, citations=cite)


def _facts_by_era(trace: Trace, model: str) -> tuple[tuple[int, ...], tuple[ModelFacts, ...]]:
    """(the steps where `model`'s facts change; the facts measured from each)."""
    starts, profiles = trace.eras(model)
    return starts, tuple(
        facts_from_profile(trace, p, _releases(trace, model, k))
        for k, p in zip(starts, profiles, strict=True))


def _releases(trace: Trace, model: str, step: int) -> dict[str, tuple[EngineRelease, ModelProfile]]:
    """Per engine of `model` whose release at `step` a record named: the record, and the
    facts in force before it."""
    out = {}
    for e in trace.engines:
        if (rel := trace.release_at(model, e, step)) is not None:
            out[e] = (rel, trace.profile_at(model, rel.step - 1) if rel.step > 0
                      else trace.profiles[model])
    return out


def histories(trace: Trace) -> dict[str, ModelHistory]:
    start = trace.start.timestamp()
    out = {}
    for model, s in trace.series.items():
        ts = start + np.arange(len(s.rps), dtype=np.float64) * trace.step_s
        rev = start + np.asarray(s.revision_steps, dtype=np.float64) * trace.step_s
        out[model] = ModelHistory.of(ts, s.rps, rev, trace.step_s, replay=True)
    return out


def simulate(policy: Policy, trace: Trace, *, blind: bool = False, seed: int = 0,
             policy_view: Trace | None = None
             ) -> tuple[dict[str, ModelOutcome], dict[str, list[Decision]]]:
    """Replay `trace` under `policy`; the outcome and the accepted decisions per model.

    Blind: the policy reads only `policy_view` (default: `blind_view(trace)`, the
    header's capacities and latencies hidden) and the simulated observations
    (noise from `seed`); the cost model and the simulator still use `trace`.
    """
    start = trace.start.timestamp()
    models = sorted(trace.series)
    learner = world = None
    if blind:
        view = policy_view if policy_view is not None else blind_view(trace)
        learner, world = BlindLearner(policy, view), LatencyWorld(trace, seed=seed)
        hist = histories(view)
    else:
        facts_by_era = {m: _facts_by_era(trace, m) for m in models}
        facts = {m: eras[0] for m, (_, eras) in facts_by_era.items()}
        hist = histories(trace)
    replays = {m: ModelReplay(trace, m) for m in models}
    # Model state by the rules the live loop uses too (`policies.model_state`).
    tenure: dict[str, Tenure | None] = dict.fromkeys(models)
    last_serving: dict[str, str | None] = dict.fromkeys(models)  # the engine of the last step
    switches: dict[str, list[SwitchRecord]] = {m: [] for m in models}
    trialled: dict[str, set[str]] = {m: set() for m in models}
    accepted: dict[str, list[Decision]] = {m: [] for m in models}
    states: dict[str, tuple[tuple[object, ...], ModelState]] = {}  # model -> (inputs, state)
    every = max(1, math.ceil(policy.doc.spec.interval / trace.step_s - 1e-9))
    settings = policy.signal_settings
    in_order = [(m, replays[m]) for m in models]
    # Blind: per model, the engine serving since step `fed_from[m]`, whose readings from
    # that step on the learner has not been handed yet (`_hand_over`).
    serving_since: dict[str, str | None] = dict.fromkeys(models)
    fed_from: dict[str, int] = dict.fromkeys(models, 0)
    if learner is not None:
        # The initial engine served each model before the trace starts (its tenure starts
        # long before): its latency at the start is known to the first decision, as the
        # header's is to a plain replay (so a breach from the first step acts there).
        assert world is not None
        for m, replay in in_order:
            serving_since[m] = replay.serving
            _hand_over(world, learner, m, replay.serving, 0, 1)
            fed_from[m] = 1

    def decide_now(k: int, now: float, which: list[str]) -> list[Decision]:
        """The decisions of `which` models at step k (their tenures moved to k)."""
        nonlocal facts
        if learner is not None:
            assert world is not None
            for m in which:  # the readings of the steps before k, as live would have
                if fed_from[m] < k:
                    _hand_over(world, learner, m, serving_since[m], fed_from[m], k)
                    fed_from[m] = k
                facts[m] = learner.facts(m, k)
        signals: dict[str, Signals] = {
            m: compute_signals(m, hist[m], facts[m], now, settings,
                               None if learner is None else learner.forecast(m, hist[m], now))
            for m in which}
        if learner is not None:  # the savings estimates' scaled windows, all models at once
            prepare_estimates(signals.values())
        state = {}
        for m in which:
            # Made again only when an input changed (the switches and trials only grow).
            key = (tenure[m], len(switches[m]), len(trialled[m]), replays[m].switching_at(k))
            made = states.get(m)
            if made is None or made[0] != key:
                made = states[m] = (key, _state(tenure[m], switches[m], trialled[m], key[3]))
            state[m] = made[1]
        return decide(policy, signals, state, now)

    if learner is not None:
        facts = {}
    for k in range(trace.n_steps):
        now = start + k * trace.step_s
        wanted: dict[str, Decision] = {}
        deciding = k % every == 0
        # The replay serves one engine at a time; a switch in flight keeps the old one.
        # The tenure changes only when that engine does (`advance_tenure`); each model's
        # tenure reads its own replay alone.
        for m, replay in in_order:
            if (engine := replay.serving_at(k)) != last_serving[m]:
                tenure[m] = _tenure(tenure[m], engine, now, start)
                last_serving[m] = engine
        if learner is None:  # a release's facts count as measured from its step
            for m, (starts, eras) in facts_by_era.items():
                if len(starts) > 1:
                    facts[m] = eras[bisect_right(starts, k) - 1]
        if deciding:
            wanted = {d.model: d for d in decide_now(k, now, models)}
        elif breaches := [m for m, replay in in_order
                          if _breach_seen(m, replay, k, learner, world, facts)]:
            # Between evaluations, a measured SLA breach of the serving engine acts at once
            # (as the live loop's urgent moves do): only urgent moves are taken here.
            wanted = {d.model: d for d in decide_now(k, now, breaches) if d.urgent}
        for m, replay in in_order:
            d = wanted.get(m) if wanted else None
            if replay.step(k, d.to_engine if d else None) and d is not None:
                # The cost model prices a trial as the switch it leads to (its contract has
                # no trial term); the replay remembers that the target (and its release)
                # was trialled.
                accepted[m].append(d)
                switches[m].append(SwitchRecord(now, SwitchOutcome.IN_FLIGHT))
                if d.trial_share is not None:
                    trialled[m].add(d.to_engine)
                    if isinstance(v := d.inputs.get(f"{ENGINE_VERSION}.{d.to_engine}"), str):
                        trialled[m].add(release_key(d.to_engine, v))
            if learner is not None and (serving := replay.serving) != serving_since[m]:
                # Step k is served by another engine: the last one's readings up to k first.
                assert world is not None
                _hand_over(world, learner, m, serving_since[m], fed_from[m], k)
                serving_since[m], fed_from[m] = serving, k
    return {m: r.outcome() for m, r in replays.items()}, accepted


def _breach_seen(model: str, replay: ModelReplay, k: int, learner: BlindLearner | None,
                 world: LatencyWorld | None, facts: Mapping[str, ModelFacts]) -> bool:
    """Whether, between evaluations, step k may show a measured SLA breach of the engine
    serving `model` (no switch in flight): plain, its facts break the SLA; blind, the
    reading of step k - 1 does (the decision then sees the learner's figure)."""
    if replay.switching_at(k) is not None or k == 0:
        return False
    serving = replay.serving_at(k)
    if learner is None:
        return breach_is_measured(facts[model], serving)
    assert world is not None
    return world.breaks_sla(model, serving, k - 1)


def _hand_over(world: LatencyWorld, learner: BlindLearner, model: str, engine: str | None,
               start: int, stop: int) -> None:
    """The world's readings of `model` on `engine` (None: no engine yet) for steps
    [start, stop) to the learner, in one batch: the learner reads its observations only
    at a decision, so handing them over then leaves the state each step's would."""
    if engine is not None and start < stop:
        learner.record(model, engine, world.readings(model, engine, start, stop))


def _tenure(tenure: Tenure | None, engine: str, now: float, start: float) -> Tenure:
    """The tenure once the replay serves `engine` at `now` (`advance_tenure`)."""
    serving = current_engine({engine: 1})
    assert serving is not None
    return advance_tenure(tenure, serving, now, first_seen=start - LONG_AGO_S)


def _state(tenure: Tenure | None, switches: list[SwitchRecord], trialled: set[str],
           migrating_to: str | None) -> ModelState:
    assert tenure is not None
    return ModelState(engine=tenure.engine, since=tenure.since, last_switch=last_switch(switches),
                      migrating_to=migrating_to, trialled=frozenset(trialled))


def _model_json(out: ModelOutcome, decisions: list[Decision]) -> dict[str, Any]:
    return {
        "switches": [{"ts": _ts(d.created_at), "to": d.to_engine, "rule": d.rule} for d in decisions],
        "gpu_hours": out.gpu_hours, "cost_usd": out.cost_usd, "flaps": out.flaps,
        "revision_lag_h": out.revision_lag_h, "sla_violation_min": out.sla_violation_min,
    }


def _ts(epoch_s: float) -> str:
    from datetime import UTC, datetime
    return format_ts(datetime.fromtimestamp(epoch_s, UTC))


def _summary(outcomes: dict[str, ModelOutcome]) -> dict[str, Any]:
    return {
        "cost_usd": round(sum(o.cost_usd for o in outcomes.values()), 2),
        "flaps": sum(o.flaps for o in outcomes.values()),
        "revision_lag_h": round(sum(o.revision_lag_h for o in outcomes.values()), 2),
        "sla_violation_min": round(sum(o.sla_violation_min for o in outcomes.values()), 2),
    }


def baseline_costs(trace: Trace) -> dict[str, dict[str, float]]:
    out = {}
    for engine in trace.engines:
        name = f"static-{engine}"
        total = sum(replay_model(trace, m, {}, initial_engine=engine).cost_usd for m in trace.series)
        out[name] = {"cost_usd": round(total, 2)}
    return out


def run_backtest(policy: Policy, trace: Trace, *, compare: Policy | None = None,
                 blind: bool = False, seed: int = 0, decisions: bool = False) -> dict[str, Any]:
    """The backtest output object of docs/cost-model.md; with `compare`, an extra ``compare`` key says where
    and at what cost the other policy decides differently. `blind`: the policies
    learn capacity from simulated latency instead of reading the header's."""
    outcomes, decided = simulate(policy, trace, blind=blind, seed=seed)
    result: dict[str, Any] = {
        "policy": policy.name,
        "trace": trace.name,
        "models": {m: _model_json(outcomes[m], decided[m]) for m in sorted(outcomes)},
        "summary": _summary(outcomes),
        "baselines": baseline_costs(trace),
    }
    if decisions:  # the accepted decisions themselves, per model (not part of the contract)
        result["decisions"] = {m: decided[m] for m in sorted(decided)}
    if compare is not None:
        other_out, other_dec = simulate(compare, trace, blind=blind, seed=seed)
        result["compare"] = _comparison(compare, result, other_out, other_dec)
    return result


def _comparison(other: Policy, mine: dict[str, Any], outcomes: dict[str, ModelOutcome],
                decisions: dict[str, list[Decision]]) -> dict[str, Any]:
    models: dict[str, Any] = {}
    for m in sorted(outcomes):
        theirs = _model_json(outcomes[m], decisions[m])
        ours = mine["models"][m]
        a = [(s["ts"], s["to"]) for s in ours["switches"]]
        b = [(s["ts"], s["to"]) for s in theirs["switches"]]
        models[m] = {
            "switches": theirs["switches"],
            "cost_usd": theirs["cost_usd"],
            "cost_delta_usd": round(theirs["cost_usd"] - ours["cost_usd"], 2),
            "only_policy": [{"ts": ts, "to": to} for ts, to in a if (ts, to) not in b],
            "only_other": [{"ts": ts, "to": to} for ts, to in b if (ts, to) not in a],
        }
    summary = _summary(outcomes)
    return {"policy": other.name, "summary": summary,
            "cost_delta_usd": round(summary["cost_usd"] - mine["summary"]["cost_usd"], 2),
            "models": models}
