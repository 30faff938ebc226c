"""Persisting a move's state: saves, and transitions checked against the table.

`MigrationLedger` is the one place a migration row is written while it runs. A
transition (`go`) is checked by `migration_machine.check_transition` before
anything is saved, so an illegal one raises `IllegalTransition` and leaves the
stored row as it was; a legal one is saved with its step-log entry in one
transaction. A trial's outcome is set here when the trial ends, as a typed
column, from how it ended.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from gearshift.controller import failpoints
from gearshift.controller.moves.machine import (
    MigrationKind,
    MigrationPhase,
    TrialOutcome,
    check_transition,
)
from gearshift.controller.moves.store import MigrationRepository, MigrationRow, MigrationStepRow

# Transitions log under the orchestrator's name, which operators filter on.
log = logging.getLogger("gearshift.controller.moves.orchestrator")

P = MigrationPhase
OnTransition = Callable[[MigrationRow, MigrationPhase, MigrationPhase, str], None]

# How a trial that did not measure its target ended, by its final phase.
_TRIAL_END = {P.ROLLED_BACK: TrialOutcome.FAILED, P.ABORTED: TrialOutcome.ABORTED}


class MigrationLedger:
    """Saves rows and checked transitions; `on_transition` observes each one after it is
    saved (for logs and tests: nothing that must happen may depend on it, since a
    crash can fall between the save and the call)."""

    def __init__(self, repo: MigrationRepository, clock: Callable[[], float],
                 on_transition: OnTransition | None = None) -> None:
        self._repo = repo
        self._clock = clock
        self._on_transition = on_transition

    def now(self) -> datetime:
        return datetime.fromtimestamp(self._clock(), UTC)

    def elapsed_s(self, row: MigrationRow) -> float:
        """Seconds since the move entered its phase."""
        return self._clock() - row.phase_entered_at.timestamp()

    def save(self, row: MigrationRow, note: str | None = None,
             figures: dict[str, Any] | None = None) -> None:
        """Persist `row` in its phase; a `note` adds a step-log entry."""
        row.updated_at = self.now()
        step = None if note is None else MigrationStepRow(
            migration_id=row.id, at=row.updated_at, from_phase=row.phase.value,
            to_phase=row.phase.value, message=note, figures=figures or {})
        self._repo.save(row, step=step)

    def go(self, row: MigrationRow, to: MigrationPhase, message: str,
           figures: dict[str, Any] | None = None) -> None:
        """Check, then persist a transition and its step-log entry (one transaction)."""
        before = row.phase
        outcome = row.trial_outcome
        if row.kind is MigrationKind.TRIAL and not to.active and outcome is None:
            outcome = _TRIAL_END.get(to)
        check_transition(row.id, row.kind, outcome, before, to)
        now = self.now()
        row.phase, row.phase_entered_at, row.updated_at = to, now, now
        row.trial_outcome = outcome
        row.healthy_intervals = 0
        row.status_message = ""
        if to is P.ROLLING_BACK and not row.reason:
            row.reason = message
        if not to.active:
            row.finished_at = now
        self._repo.save(row, step=MigrationStepRow(
            migration_id=row.id, at=now, from_phase=before.value, to_phase=to.value,
            message=message, figures=figures or {}))
        if not to.active:
            failpoints.reach(failpoints.MIGRATION_END_SAVED)
        log.info("migration %s (%s): %s -> %s: %s", row.id, row.model, before.value, to.value,
                 message)
        if self._on_transition is not None:
            try:
                self._on_transition(row, before, to, message)
            except Exception:  # an observer must not break the state machine
                log.exception("migration %s: on_transition observer failed", row.id)


__all__ = ["MigrationLedger", "OnTransition"]
