"""Decisions, model tenure, revisions and policy versions: `DecisionStore`.

A repository on the store's engine (`DecisionStore(store.engine)`, as `MigrationRepository`
and `EnrolmentStore` are); `Store` (in `controller.store.database`) opens the engine and
owns the URL handling and the schema. Sessions stay inside: callers pass and get the
SQLModel rows of `gearshift.controller.store.tables`, detached and fully loaded.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from gearshift.common.errors import AlreadyExists, InvalidArgument, NotFound
from gearshift.controller.store.tables import (
    SETTING_ACTIVE_POLICY_VERSION,
    DecisionRow,
    ModelTenureRow,
    PolicyVersionRow,
    RevisionRow,
    SettingRow,
    utcnow,
)
from gearshift.controller.store.upserts import dialect_insert, positive_limit, upsert
from gearshift.policies.core import DecisionStatus

_NAIVE_EPOCH = datetime(1970, 1, 1)  # `datetime.timestamp`'s, for UTC times read naive


class DecisionStore:
    """Policy versions, decisions, model tenure and revisions. Thread-safe (the engine's
    pool of connections)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def _session(self) -> Session:
        return Session(self._engine, expire_on_commit=False)

    # -- policy versions ---------------------------------------------------------------

    def add_policy_version(self, name: str, yaml_text: str, applied_by: str,
                           comment: str = "") -> int:
        """Store an applied policy document; returns its new version number."""
        digest = hashlib.sha256(yaml_text.encode()).hexdigest()
        row = PolicyVersionRow(name=name, yaml_text=yaml_text, digest=digest,
                               applied_by=applied_by, comment=comment)
        with self._session() as s:
            s.add(row)
            s.commit()
            assert row.version is not None
            return row.version

    def add_active_policy_version(self, name: str, yaml_text: str, applied_by: str,
                                  comment: str = "") -> int:
        """Store an applied policy document and make it the active version, in one
        transaction: a crash between the two can leave neither half (a version stored
        and never active). Returns the new version number."""
        digest = hashlib.sha256(yaml_text.encode()).hexdigest()
        row = PolicyVersionRow(name=name, yaml_text=yaml_text, digest=digest,
                               applied_by=applied_by, comment=comment)
        with self._session() as s:
            s.add(row)
            s.flush()  # assigns the version
            assert row.version is not None
            self._activate(s.connection(), row.version)
            s.commit()
            return row.version

    def _activate(self, conn: Any, version: int) -> None:
        upsert(conn, SettingRow, [{"key": SETTING_ACTIVE_POLICY_VERSION,
                                   "value": version, "updated": utcnow()}], ["key"])

    def get_policy_version(self, version: int) -> PolicyVersionRow | None:
        with self._session() as s:
            return s.get(PolicyVersionRow, version)

    def list_policy_versions(self) -> list[PolicyVersionRow]:
        """Newest first."""
        with self._session() as s:
            q = select(PolicyVersionRow).order_by(col(PolicyVersionRow.version).desc())
            return list(s.exec(q).all())

    # -- decisions ---------------------------------------------------------------------

    def add_decision(self, row: DecisionRow) -> str:
        """Store a new decision; returns its id. AlreadyExists if the id is taken."""
        with self._session() as s:
            s.add(row)
            try:
                s.commit()
            except sa.exc.IntegrityError:
                raise AlreadyExists(f"decision {row.id!r} already exists") from None
            return row.id

    def get_decision(self, decision_id: str) -> DecisionRow | None:
        with self._session() as s:
            return s.get(DecisionRow, decision_id)

    def list_decisions(self, model: str | None = None, status: DecisionStatus | None = None,
                       limit: int = 100) -> list[DecisionRow]:
        """Newest first."""
        q = select(DecisionRow).order_by(col(DecisionRow.created_at).desc(),
                                         col(DecisionRow.id)).limit(positive_limit(limit))
        if model is not None:
            q = q.where(DecisionRow.model == model)
        if status is not None:
            q = q.where(DecisionRow.status == _status(status))
        with self._session() as s:
            return list(s.exec(q).all())

    def last_decision_times(self, statuses: tuple[DecisionStatus, ...]) -> dict[str, datetime]:
        """Per model, the creation time of its newest decision in one of `statuses` (one
        query for the whole fleet: the policy tick reads every model's)."""
        table = DecisionRow.__table__  # type: ignore[attr-defined]
        newest = sa.func.max(table.c.created_at, type_=table.c.created_at.type)
        q = (sa.select(table.c.model, newest)
             .where(table.c.status.in_([_status(st) for st in statuses]))
             .group_by(table.c.model))
        with self._engine.connect() as conn:
            return {model: at for model, at in conn.execute(q)}

    def update_decision_status(self, decision_id: str, status: DecisionStatus, reason: str = "",
                               expected_from: DecisionStatus | None = None) -> bool:
        """Set a decision's status; with `expected_from`, only if it currently has that
        status (compare-and-set). Returns False when the compare failed.

        Raises NotFound for an unknown id and InvalidArgument for an unknown status.
        """
        new = _status(status)
        q = sa.update(DecisionRow).where(col(DecisionRow.id) == decision_id)
        if expected_from is not None:
            q = q.where(col(DecisionRow.status) == _status(expected_from))
        with self._engine.begin() as conn:
            res = conn.execute(q.values(status=new, status_reason=reason, updated_at=utcnow()))
            if res.rowcount:
                return True
            exists = conn.execute(sa.select(col(DecisionRow.id))
                                  .where(col(DecisionRow.id) == decision_id)).first()
        if exists is None:
            raise NotFound(f"decision {decision_id!r} not found")
        return False

    # -- model tenure ------------------------------------------------------------------

    def get_tenure(self, model: str) -> ModelTenureRow | None:
        """The engine `model` is on and since when (None: never recorded)."""
        with self._session() as s:
            return s.get(ModelTenureRow, model)

    def tenures(self) -> dict[str, tuple[str, datetime]]:
        """Every model's tenure, model -> (engine, since), as `set_tenures` takes them (one
        query for the whole fleet, read as plain rows: the policy tick reads it)."""
        table = ModelTenureRow.__table__  # type: ignore[attr-defined]
        with self._engine.connect() as conn:
            return {model: (engine, since) for model, engine, since in conn.execute(
                sa.select(table.c.model, table.c.engine, table.c.since)).all()}

    def tenure_timestamps(self) -> dict[str, tuple[str, float]]:
        """`tenures` with each `since` as POSIX seconds, read as the database gives it, not
        through `UTCDateTime` (a tick reads every model's tenure): each is, to the bit,
        `since.timestamp()`."""
        table = ModelTenureRow.__table__  # type: ignore[attr-defined]
        since_col = sa.type_coerce(table.c.since, sa.DateTime())
        with self._engine.connect() as conn:
            return {model: (engine, _posix_s(since)) for model, engine, since in conn.execute(
                sa.select(table.c.model, table.c.engine, since_col)).all()}

    def set_tenure(self, model: str, engine: str, since: datetime) -> None:
        """Record that `model` has been on `engine` since `since` (replaces the old record)."""
        self.set_tenures({model: (engine, since)})

    def set_tenures(self, tenures: dict[str, tuple[str, datetime]]) -> None:
        """`set_tenure` for many models (model -> (engine, since)), in one transaction: a
        policy tick records every model whose engine changed at once."""
        if not tenures:
            return
        table = ModelTenureRow.__table__  # type: ignore[attr-defined]
        stmt = dialect_insert(self._engine.dialect.name, table)
        stmt = stmt.on_conflict_do_update(index_elements=["model"], set_={
            "engine": stmt.excluded.engine, "since": stmt.excluded.since})
        with self._engine.begin() as conn:
            conn.execute(stmt, [{"model": m, "engine": e, "since": at}
                                for m, (e, at) in tenures.items()])

    # -- revisions ---------------------------------------------------------------------

    def add_revision(self, model: str, revision: str, published_at: datetime | None = None,
                     source: str = "") -> bool:
        """Record a published revision; False when (model, revision) was already known."""
        row = RevisionRow(model=model, revision=revision, source=source,
                          published_at=published_at or utcnow())
        table = RevisionRow.__table__  # type: ignore[attr-defined]
        stmt = dialect_insert(self._engine.dialect.name, table)
        values = row.model_dump(exclude={"id"})
        with self._engine.begin() as conn:
            res = conn.execute(stmt.values(**values).on_conflict_do_nothing(
                index_elements=["model", "revision"]).returning(col(RevisionRow.id)))
            return res.first() is not None

    def revision_timestamps(self) -> dict[str, list[float]]:
        """Per model, when each of its revisions was published (POSIX seconds), oldest first
        (one query for the whole fleet). The stored times are read as the database gives
        them, not through `UTCDateTime` (a tick reads every revision of the fleet): each
        is, to the bit, `published_at.timestamp()`."""
        table = RevisionRow.__table__  # type: ignore[attr-defined]
        at_col = sa.type_coerce(table.c.published_at, sa.DateTime())
        out: dict[str, list[float]] = {}
        with self._engine.connect() as conn:
            for model, at in conn.execute(sa.select(table.c.model, at_col)
                                          .order_by(table.c.published_at)).all():
                out.setdefault(model, []).append(_posix_s(at))
        return out

    def list_revisions(self, model: str, since: datetime | None = None) -> list[RevisionRow]:
        """Revisions of `model` published at or after `since`, oldest first."""
        q = select(RevisionRow).where(RevisionRow.model == model)
        if since is not None:
            q = q.where(col(RevisionRow.published_at) >= since)
        with self._session() as s:
            return list(s.exec(q.order_by(col(RevisionRow.published_at))).all())


def _posix_s(at: datetime) -> float:
    """A stored UTC time, as the database gives it, in POSIX seconds: to the bit what
    `UTCDateTime` reads back gives with `.timestamp()`."""
    if at.tzinfo is not None:  # PostgreSQL's: aware; SQLite's: naive, in UTC
        at = at.astimezone(UTC).replace(tzinfo=None)
    return (at - _NAIVE_EPOCH).total_seconds()


def _status(value: DecisionStatus | str) -> DecisionStatus:
    try:
        return DecisionStatus(value)
    except ValueError:
        known = ", ".join(m.value for m in DecisionStatus)
        raise InvalidArgument(f"unknown decision status {value!r}; known: {known}") from None
