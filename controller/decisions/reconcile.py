"""Decision status from migration rows, level-triggered.

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
from collections.abc import Callable

from gearshift.controller.decisions.store import DecisionStore
from gearshift.controller.moves.machine import MigrationKind, MigrationPhase
from gearshift.controller.moves.store import MigrationRepository, MigrationRow
from gearshift.controller.store.tables import DecisionRow
from gearshift.policies.core import DecisionStatus
from gearshift.policies.schema import Mode

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


def _new_status(migrations: MigrationRepository, d: DecisionRow
                ) -> tuple[DecisionStatus, str] | None:
    """What `d` becomes from its migration rows; None: it stays as it is."""
    rows = migrations.rows(decision_id=d.id)
    if not rows:
        if d.status is DecisionStatus.EXECUTING:
            return DecisionStatus.APPROVED, "approved; its migration was never stored, retrying"
        return None
    row = rows[0]
    if row.phase.active:
        if d.status is DecisionStatus.APPROVED:
            what = (f"trial {row.id}: measuring {row.to_engine} before the move"
                    if row.kind is MigrationKind.TRIAL else f"migration {row.id}")
            return DecisionStatus.EXECUTING, what
        return None
    return _outcome(row)


OnStatus = Callable[[DecisionRow, DecisionStatus], None]


def reconcile_decisions(decisions: DecisionStore, migrations: MigrationRepository,
                        on_status: OnStatus | None = None) -> int:
    """Settle every approved or executing decision from its migration rows; returns how
    many changed. `on_status` observes each change after it is stored."""
    changed = 0
    for status in (DecisionStatus.EXECUTING, DecisionStatus.APPROVED):
        for d in decisions.list_decisions(status=status, limit=RECONCILE_LIMIT):
            if d.mode == Mode.DRY_RUN:
                continue
            new = _new_status(migrations, d)
            if new is None or not decisions.update_decision_status(d.id, new[0], new[1],
                                                                   expected_from=d.status):
                continue
            changed += 1
            log.info("decision %s reconciled from its migration rows", d.id)
            if on_status is not None:
                on_status(d, new[0])
    return changed


__all__ = ["reconcile_decisions"]
