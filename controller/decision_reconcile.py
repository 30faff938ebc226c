"""Decision status from migration rows, level-triggered (STYLE 6).

A decision that a migration carries out learns how it ended from the stored
migration rows, re-read on every orchestrator tick, never from a one-shot hook:
a controller that crashed between saving a migration's end and updating its
decision finds the ended migration on its first tick after the restart and
settles the decision then. So no decision stays `executing` once its migration
has ended, and a stale `executing` decision can never suppress the same move for
ever.

The mapping, per decision (compare-and-set on the status it was read with):

| decision  | its newest migration          | becomes                                       |
|-----------|-------------------------------|-----------------------------------------------|
| approved  | active                        | executing (a crash fell before the update)    |
| approved  | ended                         | as `executing` below                          |
| executing | active                        | unchanged                                     |
| executing | engine switch `done`          | done                                          |
| executing | `rolled_back` / `aborted`     | rolled_back (counts for the cooldown)         |
| executing | trial, ended                  | superseded: the next evaluation decides on it |
| executing | none at all                   | approved again, so it is retried              |
"""

from __future__ import annotations

import logging

from gearshift.controller.migration_machine import MigrationKind, MigrationPhase
from gearshift.controller.migration_store import MigrationRepository, MigrationRow
from gearshift.controller.store import Store
from gearshift.controller.tables import DecisionRow, DecisionStatus

log = logging.getLogger(__name__)

RECONCILE_LIMIT = 200  # open decisions looked at per tick (there are a handful in practice)


def _outcome(row: MigrationRow) -> tuple[DecisionStatus, str]:
    if row.kind is MigrationKind.TRIAL:
        outcome = row.trial_outcome.value if row.trial_outcome else row.phase.value
        return (DecisionStatus.SUPERSEDED,
                f"trial {row.id} {outcome}: {row.reason or row.phase.value}; the next evaluation "
                "decides on what it measured")
    if row.phase is MigrationPhase.DONE:
        return DecisionStatus.DONE, f"migration {row.id} done"
    verb = "aborted" if row.phase is MigrationPhase.ABORTED else "rolled back"
    return DecisionStatus.ROLLED_BACK, f"migration {row.id} {verb}: {row.reason}"


def _reconcile_one(store: Store, migrations: MigrationRepository, d: DecisionRow) -> bool:
    rows = migrations.rows(decision_id=d.id)
    if not rows:
        if d.status is DecisionStatus.EXECUTING:
            return store.update_decision_status(
                d.id, DecisionStatus.APPROVED, "approved; its migration was never stored, retrying",
                expected_from=DecisionStatus.EXECUTING)
        return False
    row = rows[0]
    if row.phase.active:
        if d.status is DecisionStatus.APPROVED:
            what = (f"trial {row.id}: measuring {row.to_engine} before the move"
                    if row.kind is MigrationKind.TRIAL else f"migration {row.id}")
            return store.update_decision_status(d.id, DecisionStatus.EXECUTING, what,
                                                expected_from=DecisionStatus.APPROVED)
        return False
    status, reason = _outcome(row)
    return store.update_decision_status(d.id, status, reason, expected_from=d.status)


def reconcile_decisions(store: Store, migrations: MigrationRepository) -> int:
    """Settle every approved or executing decision from its migration rows; returns how
    many changed."""
    changed = 0
    for status in (DecisionStatus.EXECUTING, DecisionStatus.APPROVED):
        for d in store.list_decisions(status=status, limit=RECONCILE_LIMIT):
            if d.mode == "dry-run":
                continue
            if _reconcile_one(store, migrations, d):
                changed += 1
                log.info("decision %s reconciled from its migration rows", d.id)
    return changed


__all__ = ["reconcile_decisions"]
