"""The live adapter around the pure decision core (DESIGN §5).

On every policy interval (an APScheduler job) it reads the active policy, builds
each model's signals from what the fleet observed before `now` (the in-memory
rate history and its forecast over the policy's horizon, which sets the traffic
level of the savings estimate; revisions; the engines' latency; capacities by the
rule shared with the blind backtest, `controller.learning.live_capacities`:
measured, else the policy's priors or the default ratio), calls `decide`, stores
the decisions with their reasons and those figures' sources, and applies the policy's
mode: `dry-run` records, `approve` waits for a person, `auto` hands the
decision to the migration orchestrator. Policy versions are applied here,
atomically: an invalid policy never replaces the active one. A model's facts and
its rate forecast are built by `controller.policy_facts`; the rate samples are
kept by `controller.rate_history.RateHistory`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from gearshift.common.errors import (
    FailedPrecondition,
    GearshiftError,
    InvalidArgument,
    NotFound,
)
from gearshift.controller.canary import Sla
from gearshift.controller.fleet import FleetState
from gearshift.controller.policy_facts import model_facts, rate_forecast, refresh_forecasts
from gearshift.controller.rate_history import RateHistory
from gearshift.controller.store import Store
from gearshift.controller.tables import (
    SETTING_ACTIVE_POLICY_VERSION,
    DecisionRow,
    DecisionStatus,
    PolicyVersionRow,
)
from gearshift.policies.core import ModelState, decide
from gearshift.policies.loader import Policy, PolicyError, load_policy
from gearshift.policies.priors import priors_for
from gearshift.policies.schema import ModelPriors
from gearshift.policies.semantics import selector_warnings
from gearshift.policies.signals import ModelFacts, ModelHistory, compute_signals
from gearshift.v1 import agent_pb2

if TYPE_CHECKING:
    from gearshift.controller.learning import CapacityLearner, Forecaster
    from gearshift.controller.migration_store import MigrationPhase, MigrationRow
    from gearshift.controller.orchestrator import MigrationOrchestrator

log = logging.getLogger(__name__)

OPEN_STATUSES = (DecisionStatus.PROPOSED, DecisionStatus.APPROVED, DecisionStatus.EXECUTING)
TRIAL_PREFIX = "trial/"


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


@dataclass
class TickReads:
    """The store's part of one tick, read once for the fleet."""

    trials: dict[str, Any]  # "trial/<model>/<engine>" -> the stored trial result
    last_switch: dict[str, datetime]  # model -> newest done or rolled-back decision
    revisions: dict[str, list[datetime]]  # model -> publication times
    migrations: dict[str, MigrationRow]  # model -> its active migration

    def trial_result(self, model: str, engine: str) -> dict[str, Any] | None:
        value = self.trials.get(f"{TRIAL_PREFIX}{model}/{engine}")
        return value if isinstance(value, dict) else None


@dataclass
class _Seen:
    engine: str
    since: float


class PolicyLoop:
    def __init__(self, store: Store, fleet: FleetState, history: RateHistory, *,
                 paused: Callable[[], bool], clock: Callable[[], float]) -> None:
        self.store = store
        self.fleet = fleet
        self.history = history
        self.paused = paused
        self._clock = clock
        self.orchestrator: MigrationOrchestrator | None = None
        self._policy: tuple[int, Policy] | None = None
        self._seen: dict[str, _Seen] = {}
        self.on_policy_change: Callable[[Policy], None] | None = None
        # Builds what a policy implies (its schedule) before it is stored; raises
        # InvalidArgument when it cannot, and nothing is stored.
        self.prepare: Callable[[Policy], object] | None = None
        self._unloadable: int | None = None  # stored active version that no longer loads
        self.learner: CapacityLearner | None = None
        self.forecaster: Forecaster | None = None

    # -- policy versions ------------------------------------------------------------

    def active(self) -> tuple[int, Policy] | None:
        version = self.store.get_setting(SETTING_ACTIVE_POLICY_VERSION, None)
        if version is None:
            return None
        if self._policy is not None and self._policy[0] == version:
            return self._policy
        if self._unloadable == version:
            return None
        row = self.store.get_policy_version(version)
        if row is None:
            log.error("active policy version %s is missing from the store", version)
            return None
        try:
            self._policy = (version, load_policy(row.yaml_text, f"policy version {version}"))
        except PolicyError as exc:
            # Stored by an older release with looser checks: the controller still leads
            # and serves every command, with no active policy until one is applied.
            log.error("active policy version %s cannot be used; apply another: %s",
                      version, exc.message)
            self._unloadable = version
            return None
        return self._policy

    def validate(self, yaml_text: str, source: str, strict: bool = False) -> Policy:
        policy = load_policy(yaml_text, source or "<policy>", strict=strict)
        return self._with_fleet_warnings(policy, strict)

    def _with_fleet_warnings(self, policy: Policy, strict: bool) -> Policy:
        known = {m.model for m in self.fleet.models()}
        extra = selector_warnings(policy.doc, known, policy.source)
        if extra and strict:
            raise PolicyError(extra)
        return replace(policy, warnings=(*policy.warnings, *extra)) if extra else policy

    def apply(self, yaml_text: str, source: str, applied_by: str, comment: str,
              strict: bool = False) -> tuple[PolicyVersionRow, bool, Policy]:
        policy = self.validate(yaml_text, source, strict)  # raises: nothing changes
        current = self.active()
        if current is not None:
            row = self.store.get_policy_version(current[0])
            if row is not None and row.yaml_text == yaml_text:
                return row, False, policy
        if self.prepare is not None:
            self.prepare(policy)  # raises: nothing stored
        version = self.store.add_policy_version(policy.name, yaml_text, applied_by, comment)
        self.store.set_setting(SETTING_ACTIVE_POLICY_VERSION, version)
        self._policy = (version, policy)
        log.info("policy %s applied as version %d (mode %s) by %s", policy.name, version,
                 policy.mode, applied_by or "?")
        if self.on_policy_change is not None:
            self.on_policy_change(policy)
        row = self.store.get_policy_version(version)
        assert row is not None
        return row, True, policy

    def restore(self, version: int) -> tuple[PolicyVersionRow, bool]:
        row = self.store.get_policy_version(version)
        if row is None:
            raise NotFound(f"policy version {version} does not exist")
        policy = load_policy(row.yaml_text, f"policy version {version}")
        current = self.active()
        if current is not None and current[0] == version:
            return row, False
        if self.prepare is not None:
            self.prepare(policy)
        self.store.set_setting(SETTING_ACTIVE_POLICY_VERSION, version)
        self._policy = (version, policy)
        if self.on_policy_change is not None:
            self.on_policy_change(policy)
        return row, True

    # -- facts ------------------------------------------------------------------------

    def priors(self, model: str) -> ModelPriors:
        current = self.active()
        return priors_for(current[1].doc.spec.models, model) if current is not None else ModelPriors()

    def sla_for(self, model: str) -> Sla:
        p = self.priors(model)
        return Sla(ttft_p99_s=p.sla_ttft_p99_ms / 1000 if p.sla_ttft_p99_ms else None,
                   itl_p99_s=p.sla_itl_p99_ms / 1000 if p.sla_itl_p99_ms else None)

    def _ready(self, model: str) -> list[tuple[str, agent_pb2.DeploymentReport]]:
        return [(h, d) for h, d, _ in self.fleet.deployments_of(model)
                if d.phase == agent_pb2.DEPLOYMENT_PHASE_READY]

    def model_facts(self, model: str, policy: Policy,
                    reads: TickReads | None = None) -> ModelFacts | None:
        ready = self._ready(model)
        if not ready:
            return None
        reads = reads or self._reads([model])
        return model_facts(self.fleet, ready, model, priors_for(policy.doc.spec.models, model),
                           policy, self.learner, reads.trial_result)

    def model_state(self, model: str, now: float, reads: TickReads | None = None) -> ModelState | None:
        ready = self._ready(model)
        if not ready:
            return None
        reads = reads or self._reads([model])
        active = reads.migrations.get(model)
        engines = sorted({d.engine for _, d in ready})
        engine = active.from_engine if active is not None else engines[0]
        if active is None and len(engines) > 1:
            engine = max(engines, key=lambda e: sum(1 for _, d in ready if d.engine == e))
        seen = self._seen.get(model)
        if seen is None or seen.engine != engine:
            seen = self._seen[model] = _Seen(engine, now if seen else self.fleet.started)
        last = reads.last_switch.get(model)
        return ModelState(
            engine=engine, since=seen.since,
            last_switch=last.timestamp() if last is not None else None,
            migrating_to=active.to_engine if active is not None else None)

    def _reads(self, models: list[str]) -> TickReads:
        """What a tick reads from the store, in a few queries for the whole fleet."""
        migrations: dict[str, MigrationRow] = {}
        if self.orchestrator is not None:
            for row in self.orchestrator.list(active_only=True):
                migrations.setdefault(row.model, row)  # newest first, as before
        # A move that was rolled back counts as a switch for the cooldown: it cost a
        # build and a canary, and trying again at once would repeat it.
        return TickReads(
            trials=self.store.settings_with_prefix(TRIAL_PREFIX),
            last_switch=self.store.last_decision_times((DecisionStatus.DONE,
                                                        DecisionStatus.ROLLED_BACK)),
            revisions=self.store.revision_times() if len(models) != 1 else
            {models[0]: [r.published_at for r in self.store.list_revisions(models[0])]},
            migrations=migrations)

    def sample_rates(self, now: float) -> None:
        if not self.history.due(now):
            return
        rates: dict[str, float] = {}
        for _h, d, _ts in self.fleet.deployments():
            if d.phase == agent_pb2.DEPLOYMENT_PHASE_READY and d.metrics_present:
                rates[d.model] = rates.get(d.model, 0.0) + d.request_rate
        self.history.sample(now, rates)

    # -- evaluation -------------------------------------------------------------------

    def evaluate(self, now: float | None = None) -> list[DecisionRow]:
        """One pass of the policy over the fleet; returns the decisions it stored."""
        now = self._clock() if now is None else now
        if self.paused():
            return []
        current = self.active()
        if current is None:
            return []
        version, policy = current
        self._retry_approved()
        signals, states = {}, {}
        models = sorted(set(self.history.models()) | {m.model for m in self.fleet.models()})
        refresh_forecasts(self.forecaster, models, policy, now)
        reads = self._reads(models)
        for model in models:
            facts, state = self.model_facts(model, policy, reads), self.model_state(model, now, reads)
            if facts is None or state is None:
                continue
            ts, rps = self.history.arrays(model)
            revs = [at.timestamp() for at in reads.revisions.get(model, ())]
            hist = ModelHistory.of(ts, rps, sorted(revs), self.history.resolution_s)
            signals[model] = compute_signals(model, hist, facts, now, policy.signal_settings,
                                             rate_forecast(self.forecaster, model, policy, now))
            states[model] = state
        stored = []
        for d in decide(policy, signals, states, now):
            row = self._store_decision(d.to_dict(), version, policy.mode, now)
            if row is not None:
                stored.append(row)
        return stored

    def _store_decision(self, d: dict[str, Any], version: int, mode: str, now: float) -> DecisionRow | None:
        for open_row in self.store.list_decisions(model=d["model"], limit=20):
            if open_row.status not in OPEN_STATUSES:
                continue
            if open_row.to_engine == d["to_engine"]:
                return None  # the same move is already on its way
            if open_row.status == DecisionStatus.PROPOSED:
                self.store.update_decision_status(
                    open_row.id, DecisionStatus.SUPERSEDED, "a newer decision replaced it",
                    expected_from=DecisionStatus.PROPOSED)
        inputs = {**d["inputs"], "policy": d["policy_version"]}
        row = DecisionRow(
            created_at=_utc(now), model=d["model"], from_engine=d["from_engine"],
            to_engine=d["to_engine"], rule=d["rule"], inputs=inputs, expected=d["expected"],
            alternatives=d["alternatives"], policy_version=version, mode=mode,
            status=DecisionStatus.PROPOSED,
            status_reason={"dry-run": "dry-run: recorded, not executed",
                           "approve": "waiting for approval (gearshift decisions approve ID)"}
            .get(mode, ""))
        self.store.add_decision(row)
        log.info("decision %s: move %s from %s to %s (rule %s, mode %s)", row.id, row.model,
                 row.from_engine, row.to_engine, row.rule, mode)
        if mode == "auto":
            self.store.update_decision_status(row.id, DecisionStatus.APPROVED, "auto mode",
                                              expected_from=DecisionStatus.PROPOSED)
            self._execute(row.id)
        return self.store.get_decision(row.id)

    def _execute(self, decision_id: str) -> None:
        row = self.store.get_decision(decision_id)
        if row is None or row.status != DecisionStatus.APPROVED:
            return
        if self.orchestrator is None:
            self.store.update_decision_status(row.id, DecisionStatus.APPROVED,
                                              "approved; no migration executor is running")
            return
        trial = self._trial_needed(row)
        try:
            if trial is not None:
                mig = self.orchestrator.create(row.model, row.from_engine, row.to_engine,
                                               decision_id=row.id, kind="trial", trial_share=trial)
            else:
                mig = self.orchestrator.create(row.model, row.from_engine, row.to_engine,
                                               decision_id=row.id)
        except (FailedPrecondition, InvalidArgument) as exc:
            self.store.update_decision_status(row.id, DecisionStatus.APPROVED,
                                              f"approved; not started yet: {exc.message}")
            return
        what = (f"trial {mig.id}: measuring {row.to_engine} on {trial:.0%} of traffic before "
                "the move" if trial is not None else f"migration {mig.id}")
        self.store.update_decision_status(row.id, DecisionStatus.EXECUTING, what,
                                          expected_from=DecisionStatus.APPROVED)

    def _trial_needed(self, row: DecisionRow) -> float | None:
        """The trial share when the policy wants one: the target's capacity for this model
        was never measured and no trial of it has run yet."""
        current = self.active()
        if current is None or not current[1].doc.spec.trials.enabled:
            return None
        if row.inputs.get(f"capacity_source.{row.to_engine}") == "measured":
            return None
        if self.store.get_setting(f"{TRIAL_PREFIX}{row.model}/{row.to_engine}") is not None:
            return None
        return current[1].doc.spec.trials.share

    def _retry_approved(self) -> None:
        for row in self.store.list_decisions(status=DecisionStatus.APPROVED, limit=50):
            if row.mode != "dry-run":
                self._execute(row.id)

    def _trial_finished(self, row: MigrationRow, after: MigrationPhase) -> None:
        if str(after.value) not in ("done", "rolled_back", "aborted"):
            return
        result = {"migration": row.id, "outcome": str(after.value), "reason": row.reason,
                  "share": row.canary_steps[-1] if row.canary_steps else None,
                  "figures": row.last_figures,
                  "at": row.finished_at.isoformat() if row.finished_at else None}
        self.store.set_setting(f"{TRIAL_PREFIX}{row.model}/{row.to_engine}", result)
        if row.decision_id:
            with contextlib.suppress(GearshiftError):
                self.store.update_decision_status(
                    row.decision_id, DecisionStatus.SUPERSEDED,
                    f"trial {row.id} {after.value}: {row.reason}; the next evaluation decides on "
                    "what it measured", expected_from=DecisionStatus.EXECUTING)

    def trial_result(self, model: str, engine: str) -> dict[str, Any] | None:
        value = self.store.get_setting(f"{TRIAL_PREFIX}{model}/{engine}")
        return value if isinstance(value, dict) else None

    # -- people -----------------------------------------------------------------------

    def approve(self, decision_id: str, reason: str, by: str) -> DecisionRow:
        row = self._get(decision_id)
        if row.mode == "dry-run":
            raise FailedPrecondition(
                f"decision {decision_id} was made in dry-run mode; apply a policy in approve or "
                "auto mode to act on decisions")
        if not self.store.update_decision_status(
                decision_id, DecisionStatus.APPROVED, f"approved by {by or '?'}: {reason}".rstrip(": "),
                expected_from=DecisionStatus.PROPOSED):
            raise FailedPrecondition(
                f"decision {decision_id} is {self._get(decision_id).status.value}; only a proposed "
                "decision can be approved")
        self._execute(decision_id)
        return self._get(decision_id)

    def reject(self, decision_id: str, reason: str, by: str) -> DecisionRow:
        self._get(decision_id)
        if not self.store.update_decision_status(
                decision_id, DecisionStatus.REJECTED, f"rejected by {by or '?'}: {reason}",
                expected_from=DecisionStatus.PROPOSED):
            raise FailedPrecondition(
                f"decision {decision_id} is {self._get(decision_id).status.value}; only a proposed "
                "decision can be rejected")
        return self._get(decision_id)

    def _get(self, decision_id: str) -> DecisionRow:
        row = self.store.get_decision(decision_id)
        if row is None:
            raise NotFound(f"no decision {decision_id!r}")
        return row

    def on_migration_transition(self, row: MigrationRow, before: MigrationPhase,
                                after: MigrationPhase, message: str) -> None:
        if not row.decision_id:
            return
        if row.kind == "trial":
            self._trial_finished(row, after)
            return
        final = {"done": (DecisionStatus.DONE, f"migration {row.id} done"),
                 "rolled_back": (DecisionStatus.ROLLED_BACK, f"migration {row.id} rolled back: {row.reason}"),
                 "aborted": (DecisionStatus.ROLLED_BACK, f"migration {row.id} aborted: {row.reason}")}
        status = final.get(str(after.value))
        if status is None:
            return
        try:
            self.store.update_decision_status(row.decision_id, status[0], status[1],
                                              expected_from=DecisionStatus.EXECUTING)
        except GearshiftError as exc:
            log.warning("decision %s: %s", row.decision_id, exc.message)


__all__ = ["OPEN_STATUSES", "TRIAL_PREFIX", "PolicyLoop", "RateHistory"]
