"""What becomes of a decision once the core made it: recorded (a decision for the same
move already open is not stored twice; an older proposed one is superseded), approved or
rejected by a person, executed as a migration (or a trial) in `approve` and `auto`
modes, and settled from its migration rows on every tick
(`controller.decisions.reconcile`).

Every status a decision enters is observed (`on_status`: the decision metrics) after the
store accepted the change.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime

from gearshift.common.errors import FailedPrecondition, InvalidArgument, NotFound
from gearshift.controller.decisions.reconcile import reconcile_decisions
from gearshift.controller.decisions.store import DecisionStore
from gearshift.controller.moves.machine import MigrationKind
from gearshift.controller.moves.orchestrator import MigrationOrchestrator
from gearshift.controller.moves.store import MigrationRepository
from gearshift.controller.store.tables import DecisionRow
from gearshift.policies.core import Decision, DecisionStatus
from gearshift.policies.schema import Mode

log = logging.getLogger(__name__)

OPEN_STATUSES = (DecisionStatus.PROPOSED, DecisionStatus.APPROVED, DecisionStatus.EXECUTING)
# The status reason a new decision starts with, by the policy's mode.
_WAITING = {Mode.DRY_RUN: "dry-run: recorded, not executed",
            Mode.APPROVE: "waiting for approval (gearshift decisions approve ID)"}


class DecisionReview:
    """Stored decisions and their statuses. With no `orchestrator` (a loop that only
    evaluates), an approved decision waits, saying that no executor runs."""

    def __init__(self, decisions: DecisionStore, migrations: MigrationRepository, *,
                 orchestrator: MigrationOrchestrator | None = None,
                 on_status: Callable[[str, DecisionStatus], None] | None = None) -> None:
        self.decisions = decisions
        self.migrations = migrations
        self.orchestrator = orchestrator
        self._on_status = on_status

    def reconcile(self) -> int:
        """Settle decisions from their migration rows (every tick; level-triggered)."""
        return reconcile_decisions(self.decisions, self.migrations, on_status=self._observed)

    def _observed(self, row: DecisionRow, status: DecisionStatus) -> None:
        if self._on_status is not None:
            try:
                self._on_status(row.rule, status)
            except Exception:  # an observer must not break the loop
                log.exception("decision %s: on_decision observer failed", row.id)

    def _set_status(self, row: DecisionRow, status: DecisionStatus, reason: str,
                    expected_from: DecisionStatus | None = None) -> bool:
        """`DecisionStore.update_decision_status`, observed when it changed the row."""
        changed = self.decisions.update_decision_status(row.id, status, reason,
                                                        expected_from=expected_from)
        if changed:
            self._observed(row, status)
        return changed

    def record(self, d: Decision, version: int, mode: Mode, now: float) -> DecisionRow | None:
        """Store a decision of the core (None: the same move is already open); an open
        proposed decision for another move is superseded; in `auto` mode it is executed."""
        for open_row in self.decisions.list_decisions(model=d.model, limit=20):
            if open_row.status not in OPEN_STATUSES:
                continue
            if open_row.to_engine == d.to_engine:
                return None  # the same move is already on its way
            if open_row.status == DecisionStatus.PROPOSED:
                self._set_status(
                    open_row, DecisionStatus.SUPERSEDED, "a newer decision replaced it",
                    expected_from=DecisionStatus.PROPOSED)
        row = DecisionRow(
            created_at=datetime.fromtimestamp(now, UTC), model=d.model, from_engine=d.from_engine,
            to_engine=d.to_engine, rule=d.rule, inputs={**d.inputs, "policy": d.policy_version},
            expected=dict(d.expected),
            alternatives=[{"option": o, "why": w} for o, w in d.alternatives],
            policy_version=version, mode=mode.value, reason=d.reason,
            conditions=[c.to_dict(d.rule) for c in d.conditions], trial_share=d.trial_share,
            status=DecisionStatus.PROPOSED, status_reason=_WAITING.get(mode, ""))
        self.decisions.add_decision(row)
        self._observed(row, DecisionStatus.PROPOSED)
        log.info("decision %s: move %s from %s to %s (rule %s, mode %s)", row.id, row.model,
                 row.from_engine, row.to_engine, row.rule, mode)
        if mode is Mode.AUTO:
            self._set_status(row, DecisionStatus.APPROVED, "auto mode",
                             expected_from=DecisionStatus.PROPOSED)
            self._execute(row.id)
        return self.decisions.get_decision(row.id)

    def _execute(self, decision_id: str) -> None:
        row = self.decisions.get_decision(decision_id)
        if row is None or row.status != DecisionStatus.APPROVED:
            return
        if self.orchestrator is None:
            self.decisions.update_decision_status(row.id, DecisionStatus.APPROVED,
                                                  "approved; no migration executor is running")
            return
        if self.migrations.rows(decision_id=row.id):
            return  # started before a crash: `reconcile` settles it from the migration
        trial = row.trial_share  # decided by the core with the move
        try:
            mig = self.orchestrator.create(
                row.model, row.from_engine, row.to_engine, decision_id=row.id,
                kind=MigrationKind.TRIAL if trial is not None else MigrationKind.ENGINE_SWITCH,
                trial_share=trial)
        except (FailedPrecondition, InvalidArgument) as exc:
            self.decisions.update_decision_status(row.id, DecisionStatus.APPROVED,
                                                  f"approved; not started yet: {exc.message}")
            return
        what = (f"trial {mig.id}: measuring {row.to_engine} on {trial:.0%} of traffic before "
                "the move" if trial is not None else f"migration {mig.id}")
        self._set_status(row, DecisionStatus.EXECUTING, what,
                         expected_from=DecisionStatus.APPROVED)

    def retry_approved(self) -> None:
        for row in self.decisions.list_decisions(status=DecisionStatus.APPROVED, limit=50):
            if row.mode != Mode.DRY_RUN:
                self._execute(row.id)

    # -- people -----------------------------------------------------------------------

    def approve(self, decision_id: str, reason: str, by: str) -> DecisionRow:
        row = self._get(decision_id)
        if row.mode == Mode.DRY_RUN:
            raise FailedPrecondition(
                f"decision {decision_id} was made in dry-run mode; apply a policy in approve or "
                "auto mode to act on decisions")
        if not self._set_status(
                row, DecisionStatus.APPROVED, f"approved by {by or '?'}: {reason}".rstrip(": "),
                expected_from=DecisionStatus.PROPOSED):
            raise FailedPrecondition(
                f"decision {decision_id} is {self._get(decision_id).status.value}; only a proposed "
                "decision can be approved")
        self._execute(decision_id)
        return self._get(decision_id)

    def reject(self, decision_id: str, reason: str, by: str) -> DecisionRow:
        row = self._get(decision_id)
        if not self._set_status(
                row, DecisionStatus.REJECTED, f"rejected by {by or '?'}: {reason}",
                expected_from=DecisionStatus.PROPOSED):
            raise FailedPrecondition(
                f"decision {decision_id} is {self._get(decision_id).status.value}; only a proposed "
                "decision can be rejected")
        return self._get(decision_id)

    def _get(self, decision_id: str) -> DecisionRow:
        row = self.decisions.get_decision(decision_id)
        if row is None:
            raise NotFound(f"no decision {decision_id!r}")
        return row
