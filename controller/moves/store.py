"""Durable state of migrations (docs/migrations.md): one row per move, its step log, its commands.

`MigrationRow` holds everything the orchestrator needs to resume a move after a
controller restart: the phase, the canary position, the counters that matter
across restarts (typed columns, no pickles), the placement of the target
replicas and the specs of the source replicas (to restore them on rollback).
`MigrationStepRow` is the append-only log `gearshift migrations show` prints.
`MigrationCommandRow` records every command sent for a move and the agent's
answer; results are written there, never into the migration row, so a result
arriving while a tick runs cannot be lost by the tick's own save.

The tables are created by the Alembic revisions ``0002`` and ``0004`` (keep them in step).
Phases, kinds, trial outcomes and the allowed transitions are in
`controller.moves.machine`.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Field, Session, SQLModel, col, select

from gearshift.controller.moves.machine import (
    TERMINAL_PHASES,
    MigrationKind,
    MigrationPhase,
    TrialOutcome,
)
from gearshift.controller.store.tables import UTCDateTime

MIGRATION_PHASE_LENGTH = 32
MIGRATION_KIND_LENGTH = 32
TRIAL_OUTCOME_LENGTH = 16


def new_migration_id() -> str:
    """A short random id such as ``m-3f9a1c0b2e7d``."""
    return f"m-{uuid.uuid4().hex[:12]}"


def _ts(nullable: bool = False) -> Any:
    return Field(default_factory=lambda: datetime.now(UTC), sa_type=UTCDateTime,
                 nullable=nullable)


def _json(factory: Any) -> Any:
    return Field(default_factory=factory, sa_type=sa.JSON, nullable=False)


def _enum(cls: type[Any], length: int) -> Any:
    """A str enum stored as its value (a VARCHAR, checked on the way in and out)."""
    return sa.Enum(cls, native_enum=False, length=length, create_constraint=False,
                   values_callable=lambda e: [m.value for m in e], validate_strings=True)


class MigrationRow(SQLModel, table=True):
    """One move of a model between engines (or to a new revision)."""

    __tablename__ = "migrations"

    id: str = Field(default_factory=new_migration_id, primary_key=True)
    decision_id: str | None = None
    model: str = Field(index=True)
    kind: MigrationKind = Field(default=MigrationKind.ENGINE_SWITCH,
                                sa_type=_enum(MigrationKind, MIGRATION_KIND_LENGTH))
    from_engine: str
    to_engine: str
    target_revision: str | None = None
    phase: MigrationPhase = Field(
        default=MigrationPhase.PENDING,
        sa_type=_enum(MigrationPhase, MIGRATION_PHASE_LENGTH), index=True)
    canary_step: int = 0  # index into canary_steps of the step under analysis
    canary_steps: list[float] = _json(list)  # target traffic share per step, e.g. [0.1, 0.5]
    source_deployment_ids: list[str] = _json(list)
    # per source replica: {"host_id": str, "spec": DeploymentSpec fields}; restored on rollback
    source_specs: list[dict[str, Any]] = _json(list)
    # per target replica: {"replica": int, "host_id": str, "replaces": source id or None,
    #                      "late": bool, "spec": DeploymentSpec fields}
    target_specs: list[dict[str, Any]] = _json(list)
    target_deployment_ids: list[str] = _json(list)
    target_restarts: dict[str, int] = _json(dict)  # restarts when the target was first ready
    error_marks: dict[str, int] = _json(dict)  # errors_total per target at the last interval
    reason: str = ""  # why it rolled back or was aborted (a trial: what it measured)
    trial_outcome: TrialOutcome | None = Field(  # trials only, once they end
        default=None, sa_type=_enum(TrialOutcome, TRIAL_OUTCOME_LENGTH), nullable=True)
    status_message: str = ""  # what the move waits for right now (paused, no data, capacity)
    abort_requested: bool = False
    healthy_intervals: int = 0  # good report intervals in this phase (warming) or canary step
    failed_checks: int = 0  # failed canary analyses over the whole canary
    no_data_intervals: int = 0  # intervals in which the candidate had no latency samples
    observed_report_s: float | None = None  # clock time of the newest interval already counted
    last_figures: dict[str, Any] = _json(dict)  # numbers of the last canary analysis
    phase_entered_at: datetime = _ts()
    created_at: datetime = _ts()
    updated_at: datetime = _ts()
    finished_at: datetime | None = _ts(nullable=True)


class MigrationStepRow(SQLModel, table=True):
    """One entry of a migration's step log (a transition or a notable event)."""

    __tablename__ = "migration_steps"

    id: int | None = Field(default=None, primary_key=True)
    migration_id: str = Field(index=True)
    at: datetime = _ts()
    from_phase: str
    to_phase: str
    message: str = Field(default="", sa_type=sa.Text)
    figures: dict[str, Any] = _json(dict)


class MigrationCommandRow(SQLModel, table=True):
    """A command sent to an agent for a migration, and the agent's latest answer."""

    __tablename__ = "migration_commands"

    command_id: str = Field(primary_key=True)  # "<migration id>:<action>:<subject>"
    migration_id: str = Field(index=True)
    host_id: str
    kind: str  # "start" | "drain" | "stop" | "build"
    phase: str = "sent"  # "sent" until the agent answers, then its CommandPhase name
    message: str = ""
    sent_at: datetime = _ts()
    updated_at: datetime = _ts()


class MigrationRepository:
    """Typed access to the migration tables over the store's SQLAlchemy engine."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def _session(self) -> Session:
        return Session(self._engine, expire_on_commit=False)

    def add(self, row: MigrationRow, message: str) -> MigrationRow:
        """Insert a new migration and the first entry of its step log."""
        with self._session() as s:
            s.add(row)
            s.add(MigrationStepRow(migration_id=row.id, at=row.created_at, from_phase="",
                                   to_phase=row.phase.value, message=message))
            s.commit()
        return row

    def save(self, row: MigrationRow, *, step: MigrationStepRow | None = None) -> None:
        """Persist `row` (and append `step`) in one transaction."""
        with self._session() as s:
            s.merge(row)
            if step is not None:
                s.add(step)
            s.commit()

    def get(self, migration_id: str) -> MigrationRow | None:
        with self._session() as s:
            return s.get(MigrationRow, migration_id)

    def rows(self, *, active_only: bool = False, ended_only: bool = False,
             model: str | None = None, decision_id: str | None = None,
             kind: MigrationKind | None = None) -> list[MigrationRow]:
        """Newest first."""
        q = select(MigrationRow).order_by(col(MigrationRow.created_at).desc(),
                                          col(MigrationRow.id))
        if active_only:
            q = q.where(col(MigrationRow.phase).not_in(list(TERMINAL_PHASES)))
        if model is not None:
            q = q.where(MigrationRow.model == model)
        if ended_only:
            q = q.where(col(MigrationRow.phase).in_(list(TERMINAL_PHASES)))
        if decision_id is not None:
            q = q.where(MigrationRow.decision_id == decision_id)
        if kind is not None:
            q = q.where(MigrationRow.kind == kind)
        with self._session() as s:
            return list(s.exec(q).all())

    def steps(self, migration_id: str) -> list[MigrationStepRow]:
        """The step log of a migration, oldest first."""
        q = (select(MigrationStepRow).where(MigrationStepRow.migration_id == migration_id)
             .order_by(col(MigrationStepRow.id)))
        with self._session() as s:
            return list(s.exec(q).all())

    def record_command(self, row: MigrationCommandRow) -> None:
        """Record a sent command; recording the same id again (a re-send of an unanswered
        command) only moves its `sent_at`."""
        with self._session() as s:
            known = s.get(MigrationCommandRow, row.command_id)
            if known is None:
                s.add(row)
            elif known.phase == "sent":
                known.sent_at = row.sent_at
                s.add(known)
            s.commit()

    def update_command(self, command_id: str, phase: str, message: str,
                       at: datetime) -> MigrationCommandRow | None:
        """Store the agent's answer to a command; None when the id is not a migration's.

        A late replay of an earlier, non-final phase never overwrites a final one.
        """
        with self._session() as s:
            row = s.get(MigrationCommandRow, command_id)
            if row is None:
                return None
            if row.phase in FINAL_COMMAND_PHASES and phase not in FINAL_COMMAND_PHASES:
                return row
            row.phase, row.message, row.updated_at = phase, message, at
            s.add(row)
            s.commit()
            return row

    def commands(self, migration_id: str) -> dict[str, MigrationCommandRow]:
        q = select(MigrationCommandRow).where(MigrationCommandRow.migration_id == migration_id)
        with self._session() as s:
            return {c.command_id: c for c in s.exec(q).all()}


FINAL_COMMAND_PHASES = frozenset({"succeeded", "failed", "rejected"})


__all__ = ["FINAL_COMMAND_PHASES", "TERMINAL_PHASES", "MigrationCommandRow", "MigrationKind",
           "MigrationPhase", "MigrationRepository", "MigrationRow", "MigrationStepRow",
           "TrialOutcome", "new_migration_id"]
