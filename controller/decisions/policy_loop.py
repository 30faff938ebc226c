"""The live adapter around the pure decision core (docs/decisions.md).

On every policy interval (an APScheduler job) it reads the active policy, builds
each model's signals from what the fleet observed before `now` (the in-memory
rate history and its forecast over the policy's horizon, which sets the traffic
level of the savings estimate; revisions; the engines' latency; capacities by the
rule shared with the blind backtest, `controller.decisions.learning.live_capacities`:
measured, else the policy's priors or the default ratio), calls `decide`, and hands
the decisions, with their reasons and those figures' sources, to
`controller.decisions.review.DecisionReview`, which stores them and applies the policy's
mode: `dry-run` records, `approve` waits for a person, `auto` hands the decision to the
migration orchestrator (as a trial first when the core decided one). The active policy
comes from `controller.decisions.versions.PolicyVersions`. A model's facts and its rate forecast are built by
`controller.decisions.facts`; the rate samples are kept by
`controller.ingest.rate_history.RateHistory`, which the term's rate series
(`controller.ingest.series.RateSeries`) seeds and feeds.

A model's state (current engine, time on it, the last switch for the cooldown,
engines already trialled) comes from the functions of `policies.model_state`,
which the backtest uses too; the time on an engine is stored (`model_tenure`),
so a restart keeps it. Decision status follows the migration rows, re-read on
every tick (`controller.decisions.reconcile`). Everything here runs on the
controller's event loop, as the orchestrator does: one execution context.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from gearshift.controller.decisions.facts import (
    FactsCache,
    hand_off_forecasts,
    model_facts,
    rate_forecasts,
    refresh_forecasts,
)
from gearshift.controller.decisions.review import DecisionReview
from gearshift.controller.decisions.store import DecisionStore
from gearshift.controller.decisions.versions import PolicyVersions
from gearshift.controller.ingest.fleet import FleetState
from gearshift.controller.ingest.rate_history import RateHistory
from gearshift.controller.moves.machine import MigrationKind
from gearshift.controller.moves.store import MigrationRepository, MigrationRow
from gearshift.controller.store.database import Store
from gearshift.controller.store.tables import (
    DecisionRow,
)
from gearshift.policies.core import (
    DecisionStatus,
    ModelState,
    cost_settings,
    decide_explained,
)
from gearshift.policies.fleet_estimates import estimate_fleet_moves
from gearshift.policies.fleet_signals import FleetModel, compute_fleet_signals
from gearshift.policies.holds import NoDecision, NoDecisionReason
from gearshift.policies.loader import Policy
from gearshift.policies.model_state import (
    COUNTS_FOR_COOLDOWN,
    SwitchOutcome,
    SwitchRecord,
    Tenure,
    advance_tenure,
    current_engine,
    last_switch,
)
from gearshift.policies.priors import priors_for
from gearshift.policies.signals import ModelFacts
from gearshift.v1 import agent_pb2

if TYPE_CHECKING:
    from gearshift.controller.decisions.learning import CapacityLearner, Forecaster

log = logging.getLogger(__name__)

# What became of a decision, for the cooldown (`policies.model_state`); a trial's
# decision ends superseded and is no switch. The statuses whose newest decision the
# tick reads are those whose outcome counts for the cooldown.
_SWITCH_OUTCOMES = {DecisionStatus.EXECUTING: SwitchOutcome.IN_FLIGHT,
                    DecisionStatus.DONE: SwitchOutcome.DONE,
                    DecisionStatus.ROLLED_BACK: SwitchOutcome.ROLLED_BACK}
COOLDOWN_STATUSES = tuple(s for s, o in _SWITCH_OUTCOMES.items() if o in COUNTS_FOR_COOLDOWN)
# A tick logs each model whose reason for no decision changed, up to this many lines; the
# rest (a fleet's first tick: every model) in one line of counts by reason.
REASON_LOG_LINES_PER_TICK = 20
_NO_READY = "no ready deployment on any host"
_ALREADY_DECIDED = "the same move is already decided and open (gearshift decisions list --model {})"


@dataclass
class Evaluation:
    """One evaluation: the decisions it stored and, when asked for (`PolicyLoop.evaluate`'s
    `explain`), every other model's reason for none, in words."""

    rows: list[DecisionRow]
    no_decision: list[NoDecision] = field(default_factory=list)


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


@dataclass
class TickReads:
    """The store's part of one tick, read once for the fleet."""

    trials: dict[tuple[str, str], MigrationRow]  # (model, engine) -> its newest ended trial
    last_switch: dict[str, datetime]  # model -> newest decision that counts for the cooldown
    revisions: dict[str, list[float]]  # model -> publication times (POSIX s), oldest first
    migrations: dict[str, MigrationRow]  # model -> its active migration
    tenure: dict[str, Tenure]  # model -> the engine it is on and since when (stored)
    # Tenures this tick changed, stored together at its end (`PolicyLoop.evaluate`).
    tenure_changes: dict[str, Tenure] = field(default_factory=dict)
    trialled: dict[str, frozenset[str]] = field(init=False)  # model -> engines trialled
    # model -> (engine, when its newest ended trial started): a release that started before
    # it was trialled (`ModelState.trialled_at`)
    trialled_at: dict[str, tuple[tuple[str, float], ...]] = field(init=False)

    def __post_init__(self) -> None:
        engines: dict[str, set[str]] = {}
        times: dict[str, list[tuple[str, float]]] = {}
        for (model, engine), row in self.trials.items():
            engines.setdefault(model, set()).add(engine)
            times.setdefault(model, []).append((engine, row.created_at.timestamp()))
        self.trialled = {m: frozenset(e) for m, e in engines.items()}
        self.trialled_at = {m: tuple(t) for m, t in times.items()}

    def trial_result(self, model: str, engine: str) -> dict[str, Any] | None:
        row = self.trials.get((model, engine))
        return None if row is None else _trial_dict(row)


class PolicyLoop:
    """The evaluation: each model's facts and state, the core's verdict, and the decisions
    handed to `review`. The active policy comes from `policies`; the rate series from
    `history` (seeded and sampled by the term's `controller.ingest.series.RateSeries`)."""

    def __init__(self, store: Store, decisions: DecisionStore, fleet: FleetState,
                 history: RateHistory, *,
                 paused: Callable[[], bool], clock: Callable[[], float],
                 policies: PolicyVersions | None = None, review: DecisionReview | None = None,
                 learner: CapacityLearner | None = None, forecaster: Forecaster | None = None,
                 gpu_price_per_hour: float | None = None) -> None:
        self.store = store
        self.decisions = decisions
        self.fleet = fleet
        self.history = history
        self.paused = paused
        self._clock = clock
        # The fleet's USD per GPU-hour (`--gpu-price-per-hour`), for policies that set
        # none; a host's label overrides it (`controller.decisions.gpu_price`).
        self.gpu_price_per_hour = gpu_price_per_hour
        self.policies = policies or PolicyVersions(store, decisions, fleet,
                                                   gpu_price_per_hour=gpu_price_per_hour)
        self.review = review or DecisionReview(decisions, MigrationRepository(store.engine))
        self.migrations = self.review.migrations
        self.learner = learner
        self.forecaster = forecaster
        # model -> the reason for no decision last logged (a reason is logged when it changes)
        self._logged_reasons: dict[str, NoDecisionReason] = {}

    # -- facts ------------------------------------------------------------------------

    def _ready(self, model: str) -> list[tuple[str, agent_pb2.DeploymentReport]]:
        return [(h, d) for h, d, _ in self.fleet.deployments_of(model)
                if d.phase == agent_pb2.DEPLOYMENT_PHASE_READY]

    def _ready_by_model(self) -> dict[str, list[tuple[str, agent_pb2.DeploymentReport]]]:
        """`_ready` of every model, from one walk over the fleet (each report parsed once),
        in the same order (by host, then as reported)."""
        out: dict[str, list[tuple[str, agent_pb2.DeploymentReport]]] = {}
        for h, d, _ in self.fleet.deployments():
            if d.phase == agent_pb2.DEPLOYMENT_PHASE_READY:
                out.setdefault(d.model, []).append((h, d))
        for ready in out.values():
            if len(ready) > 1:
                ready.sort(key=lambda hd: hd[0])  # stable: a host's deployments keep their order
        return out

    def model_facts(self, model: str, policy: Policy,
                    reads: TickReads | None = None) -> ModelFacts | None:
        ready = self._ready(model)
        if not ready:
            return None
        reads = reads or self._reads([model])
        return model_facts(self.fleet, ready, model, priors_for(policy.doc.spec.models, model),
                           policy, self.learner, reads.trial_result,
                           FactsCache(policy, self.learner, self.gpu_price_per_hour))

    def model_state(self, model: str, now: float, reads: TickReads | None = None) -> ModelState | None:
        """Where `model` stands, by the rules of `policies.model_state`; the time on its
        engine is stored, so a restarted controller keeps it."""
        ready = self._ready(model)
        if not ready:
            return None
        if reads is not None:
            return self._state(model, ready, now, reads, batched=True)
        return self._state(model, ready, now, self._reads([model]), batched=False)

    def _state(self, model: str, ready: list[tuple[str, agent_pb2.DeploymentReport]], now: float,
               reads: TickReads, batched: bool) -> ModelState:
        active = reads.migrations.get(model)
        replicas: dict[str, int] = {}
        for _, d in ready:
            replicas[d.engine] = replicas.get(d.engine, 0) + 1
        previous = reads.tenure.get(model)
        engine = current_engine(replicas, moving_from=active.from_engine if active else None,
                                previous=previous.engine if previous else None)
        assert engine is not None
        tenure = advance_tenure(previous, engine, now, first_seen=self.fleet.started)
        if tenure is not previous:  # `advance_tenure` returns it when nothing changed
            reads.tenure[model] = tenure
            if batched:  # the tick stores them all at once
                reads.tenure_changes[model] = tenure
            else:
                self.decisions.set_tenure(model, tenure.engine, _utc(tenure.since))
        last = reads.last_switch.get(model)  # most models: none (no switch to weigh)
        return ModelState(
            engine=tenure.engine, since=tenure.since,
            last_switch=None if last is None else last_switch(
                [SwitchRecord(last.timestamp(), SwitchOutcome.DONE)]),
            migrating_to=active.to_engine if active is not None else None,
            trialled=reads.trialled.get(model, frozenset()),
            trialled_at=reads.trialled_at.get(model, ()))

    def _reads(self, models: list[str]) -> TickReads:
        """What a tick reads from the store, in a few queries for the whole fleet."""
        migrations: dict[str, MigrationRow] = {}
        for row in self.migrations.rows(active_only=True):
            migrations.setdefault(row.model, row)  # newest first
        trials: dict[tuple[str, str], MigrationRow] = {}
        for row in self.migrations.rows(kind=MigrationKind.TRIAL, ended_only=True):
            trials.setdefault((row.model, row.to_engine), row)  # newest first
        return TickReads(
            trials=trials,
            last_switch=self.decisions.last_decision_times(COOLDOWN_STATUSES),
            revisions=self.decisions.revision_timestamps() if len(models) != 1 else
            {models[0]: [r.published_at.timestamp()
                         for r in self.decisions.list_revisions(models[0])]},
            migrations=migrations,
            tenure={model: Tenure(engine, since)
                    for model, (engine, since) in self.decisions.tenure_timestamps().items()})

    # -- evaluation -------------------------------------------------------------------

    def evaluate(self, now: float | None = None) -> list[DecisionRow]:
        """One pass of the policy over the fleet; returns the decisions it stored."""
        return self.evaluate_explained(now, explain=False).rows

    def evaluate_explained(self, now: float | None = None, explain: bool = True) -> Evaluation:
        """`evaluate`, with (`explain`) each model that got no decision and why
        (`gearshift decisions evaluate`)."""
        now = self._clock() if now is None else now
        if self.paused():
            return Evaluation([], [NoDecision(m, NoDecisionReason.PAUSED,
                                              "automation paused (gearshift resume)")
                                   for m in self._models()] if explain else [])
        current = self.policies.active()
        if current is None:
            return Evaluation([])
        version, policy = current
        self.review.reconcile()
        self.review.retry_approved()
        models = self._models()
        refresh_forecasts(self.forecaster, models, policy, now)
        collecting = gc.isenabled()
        # The tick's records (facts, signals, states, estimates: tens of objects a model)
        # live until its end and then go with their references, so the young collections
        # their allocation starts (about 800 at 10,000 models, 50-70 ms) free almost
        # nothing (under 200 objects): none run during the tick; the collector's schedule
        # (`controller.gc_policy`) resumes after it.
        gc.disable()
        try:
            evaluation = self._evaluate(models, version, policy, now, explain)
            if self.learner is not None:
                self.learner.releases_settled()  # releases first seen from now on are new
            return evaluation
        finally:
            if collecting:
                gc.enable()
            hand_off_forecasts(self.forecaster, models, policy, now)

    def _models(self) -> list[str]:
        return sorted(set(self.history.models()) | self.fleet.model_names())

    def _evaluate(self, models: list[str], version: int, policy: Policy,
                  now: float, explain: bool = False) -> Evaluation:
        reads = self._reads(models)
        cache = FactsCache(policy, self.learner, self.gpu_price_per_hour, now)
        wanted: dict[str, FleetModel] = {}
        states: dict[str, ModelState] = {}
        ready_of = self._ready_by_model()
        trial_result = reads.trial_result if reads.trials else None  # none: none asked
        forecast_of = rate_forecasts(self.forecaster, policy, now)
        # Models the core never sees, with their reason for no decision (in words on demand).
        unseen: dict[str, tuple[NoDecisionReason, str]] = {}
        for model in models:
            ready = ready_of.get(model)
            if not ready:
                unseen[model] = (NoDecisionReason.NO_READY_DEPLOYMENT, _NO_READY)
                continue
            facts = model_facts(self.fleet, ready, model, cache.priors(model), policy,
                                self.learner, trial_result, cache)
            states[model] = self._state(model, ready, now, reads, batched=True)
            revs = reads.revisions.get(model, [])
            wanted[model] = FleetModel(facts, revs, forecast_of(model))
        # Every model's signals at once, from the history's rows as they stand (nothing
        # samples the history during a tick: one event loop).
        signals = compute_fleet_signals(self.history.axis(), self.history.blocks(), wanted, now,
                                        policy.signal_settings, self.history.resolution_s)
        self.decisions.set_tenures({m: (t.engine, _utc(t.since))
                                    for m, t in reads.tenure_changes.items()})
        # Every model's savings estimates at once (the same figures as one at a time).
        estimates = estimate_fleet_moves(
            signals, {m: st.engine for m, st in states.items()
                      if st.migrating_to is None and not st.frozen}, cost_settings(policy))
        verdict = decide_explained(policy, signals, states, now, estimates=estimates)
        stored = []
        for d in verdict.decisions:
            row = self.review.record(d, version, policy.mode, now)
            if row is not None:
                stored.append(row)
            else:
                unseen[d.model] = (NoDecisionReason.ALREADY_DECIDED,
                                   _ALREADY_DECIDED.format(d.model))
        reasons: dict[str, NoDecisionReason] = verdict.reasons()
        for model, (reason, _) in unseen.items():
            reasons[model] = reason

        def words(model: str) -> NoDecision:
            if model in unseen:
                reason, detail = unseen[model]
                return NoDecision(model, reason, detail)
            return verdict.explain(model)

        self._log_reasons(reasons, words)
        no_decision = [words(m) for m in sorted(reasons)] if explain else []
        return Evaluation(stored, no_decision)

    def _log_reasons(self, reasons: dict[str, NoDecisionReason],
                     words: Callable[[str], NoDecision]) -> None:
        """Log each model whose reason for no decision changed since it was last logged
        (a model that got a decision forgets its reason); words only for those logged."""
        previous = self._logged_reasons
        changed = [m for m, r in reasons.items() if previous.get(m) is not r]
        self._logged_reasons = reasons
        for model in changed[:REASON_LOG_LINES_PER_TICK]:
            log.info("model %s: no decision: %s", model, words(model).detail)
        if rest := changed[REASON_LOG_LINES_PER_TICK:]:
            counts: dict[str, int] = {}
            for model in rest:
                counts[reasons[model].value] = counts.get(reasons[model].value, 0) + 1
            log.info("no decision for %d more model(s) whose reason changed: %s", len(rest),
                     ", ".join(f"{r} {n}" for r, n in sorted(counts.items())))

    def trial_result(self, model: str, engine: str) -> dict[str, Any] | None:
        """The newest ended trial of `engine` for `model`, from the migration rows."""
        return self._reads([model]).trial_result(model, engine)


def _trial_dict(row: MigrationRow) -> dict[str, Any]:
    return {"migration": row.id,
            "outcome": row.trial_outcome.value if row.trial_outcome else row.phase.value,
            "reason": row.reason, "share": row.canary_steps[-1] if row.canary_steps else None,
            "figures": row.last_figures,
            "at": row.finished_at.isoformat() if row.finished_at else None}


__all__ = ["Evaluation", "PolicyLoop", "RateHistory"]
