"""The controller's durable store: SQLite (WAL) by default, PostgreSQL for HA.

`Store.open(url)` validates the URL, connects, and brings the schema to the
newest Alembic revision (the migrations live in `gearshift.controller.store.schema`;
the Alembic Config is built here, no alembic.ini). Sessions stay inside: callers
pass and get the SQLModel rows of `gearshift.controller.store.tables`, detached and
fully loaded. Upserts use each dialect's ``INSERT … ON CONFLICT`` so a batch is
one statement per table. `write_batch` is the one-transaction entry point of the
`BatchingWriter`. Decisions, revisions and policy versions are queried by a
`DecisionStore` (`controller.decisions.store`) built on `Store.engine`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import StaticPool
from sqlmodel import Session, SQLModel, col, select

from gearshift.common.errors import ConfigError, InvalidArgument, Unavailable
from gearshift.controller.enrolment.store import BootstrapTokenRow, HostEnrolmentRow
from gearshift.controller.store.tables import (
    SETTING_EPOCH,
    SETTING_TYPES,
    CommandLogRow,
    DeploymentRow,
    HostRow,
    RollupRow,
    SettingRow,
    utcnow,
)
from gearshift.controller.store.upserts import dialect_insert, positive_limit, upsert

SQLITE_BUSY_TIMEOUT_MS = 5000
SQLITE_DB_FILENAME = "gearshift.db"
SUPPORTED_URLS = "sqlite:///PATH, postgresql+psycopg://USER@HOST:PORT/DB"
SCHEMA_DIR = Path(__file__).resolve().parent / "schema"  # the Alembic revisions
# Tables defined outside `tables`, named here so that every store knows its full schema.
OTHER_TABLES = (BootstrapTokenRow, HostEnrolmentRow)


MIGRATION_LOCK_KEY = 0x6765617273  # advisory lock held while the schema is migrated


def default_sqlite_url(data_dir: Path) -> str:
    """``sqlite:///<data_dir>/gearshift.db``, creating `data_dir` if needed."""
    data_dir = Path(data_dir).expanduser()
    data_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(data_dir / SQLITE_DB_FILENAME).resolve()}"


def alembic_config(connection: Connection) -> Config:
    """An Alembic Config for the store's migrations, bound to an open connection."""
    cfg = Config()
    cfg.set_main_option("script_location", str(SCHEMA_DIR))
    cfg.attributes["connection"] = connection
    return cfg


def _parse_url(url: str) -> sa.URL:
    try:
        parsed = sa.make_url(url)
    except (sa.exc.ArgumentError, ValueError):
        scheme = url.split("://", 1)[0] if "://" in url else "(none)"
        raise ConfigError(
            f"database URL is not a valid URL (scheme {scheme!r}); supported: {SUPPORTED_URLS}"
        ) from None
    if parsed.drivername in ("sqlite", "sqlite+pysqlite"):
        return parsed
    if parsed.drivername in ("postgresql", "postgresql+psycopg"):
        return parsed.set(drivername="postgresql+psycopg")
    raise ConfigError(
        f"unsupported database URL scheme {parsed.drivername!r}; supported: {SUPPORTED_URLS}"
    )


def _sqlite_on_connect(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes in WAL mode
    cur.close()


def _create_engine(url: sa.URL) -> Engine:
    if url.drivername.startswith("sqlite"):
        memory = url.database in (None, "", ":memory:")
        if not memory:
            Path(url.database or "").parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            poolclass=StaticPool if memory else None,
        )
        sa.event.listen(engine, "connect", _sqlite_on_connect)
        return engine
    return sa.create_engine(url, pool_pre_ping=True)


def _dump(rows: Iterable[SQLModel]) -> list[dict[str, Any]]:
    return [row.model_dump() for row in rows]


@dataclass
class WriteBatch:
    """What one writer flush commits in one transaction (each list keyed, last wins)."""

    hosts: list[HostRow] = field(default_factory=list)
    deployments: list[DeploymentRow] = field(default_factory=list)
    deleted_deployments: list[str] = field(default_factory=list)
    rollups: list[RollupRow] = field(default_factory=list)
    commands: list[CommandLogRow] = field(default_factory=list)

    def __len__(self) -> int:
        return (len(self.hosts) + len(self.deployments) + len(self.deleted_deployments)
                + len(self.rollups) + len(self.commands))


class Store:
    """Typed access to the controller's tables. Thread-safe (a pool of connections).

    Decisions, revisions and policy versions are `DecisionStore`'s (built on `engine`)."""

    def __init__(self, engine: Engine, safe_url: str) -> None:
        self._engine = engine
        self.url = safe_url  # password hidden

    @classmethod
    def open(cls, url: str) -> Store:
        """Connect to `url` and run the migrations up to head (idempotent)."""
        parsed = _parse_url(url)
        safe = parsed.render_as_string(hide_password=True)
        engine = _create_engine(parsed)
        try:
            with engine.begin() as conn:
                if engine.dialect.name == "postgresql":
                    # Controllers of one HA group may start together: one migrates, the
                    # others wait here (the lock ends with this transaction).
                    conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"),
                                 {"key": MIGRATION_LOCK_KEY})
                command.upgrade(alembic_config(conn), "head")
        except sa.exc.OperationalError as err:
            engine.dispose()
            raise Unavailable(f"cannot open database {safe}: {err.orig}") from None
        return cls(engine, safe)

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine, for repositories of other modules' tables."""
        return self._engine

    @property
    def dialect(self) -> str:
        """``"sqlite"`` or ``"postgresql"``."""
        return self._engine.dialect.name

    def close(self) -> None:
        self._engine.dispose()

    def _session(self) -> Session:
        return Session(self._engine, expire_on_commit=False)

    # -- batches (the BatchingWriter's one transaction) ------------------------------

    def write_batch(self, batch: WriteBatch) -> None:
        """Commit everything in `batch` in one transaction, or nothing."""
        with self._engine.begin() as conn:
            upsert(conn, HostRow, _dump(batch.hosts), ["host_id"], ["first_seen"])
            upsert(conn, DeploymentRow, _dump(batch.deployments), ["deployment_id"])
            if batch.deleted_deployments:
                conn.execute(sa.delete(DeploymentRow).where(
                    col(DeploymentRow.deployment_id).in_(batch.deleted_deployments)))
            upsert(conn, RollupRow, _dump(batch.rollups), ["model", "engine", "minute"])
            upsert(conn, CommandLogRow, _dump(batch.commands), ["command_id"],
                         ["created", "host_id", "epoch", "kind", "payload"])

    # -- hosts and deployments ---------------------------------------------------------

    def upsert_hosts(self, rows: Iterable[HostRow]) -> None:
        """Insert or replace hosts; an existing host keeps its `first_seen`."""
        self.write_batch(WriteBatch(hosts=list(rows)))

    def get_host(self, host_id: str) -> HostRow | None:
        with self._session() as s:
            return s.get(HostRow, host_id)

    def list_hosts(self) -> list[HostRow]:
        with self._session() as s:
            return list(s.exec(select(HostRow).order_by(col(HostRow.host_id))).all())

    def hosts_seen_before(self, cutoff: datetime) -> list[tuple[str, datetime, bool]]:
        """(host_id, last_seen, reported) of the hosts last seen at or before `cutoff`,
        oldest first: pruning's candidates, chosen by the database. Three columns, not
        rows: loading a fleet of 10,000 hosts as rows to find none took most of a second
        of a thread holding the GIL, a second of late acks on the event loop."""
        query = (sa.select(col(HostRow.host_id), col(HostRow.last_seen),
                           col(HostRow.last_report_seq).is_not(None))
                 .where(col(HostRow.last_seen) <= cutoff).order_by(col(HostRow.last_seen)))
        with self._engine.connect() as conn:
            return [(host_id, seen, bool(reported))
                    for host_id, seen, reported in conn.execute(query)]

    def delete_hosts(self, host_ids: Iterable[str]) -> int:
        """Remove hosts and their deployments; returns how many hosts were removed."""
        ids = list(host_ids)
        if not ids:
            return 0
        with self._engine.begin() as conn:
            conn.execute(sa.delete(DeploymentRow).where(col(DeploymentRow.host_id).in_(ids)))
            result = conn.execute(sa.delete(HostRow).where(col(HostRow.host_id).in_(ids)))
        return int(result.rowcount or 0)

    def upsert_deployments(self, rows: Iterable[DeploymentRow]) -> None:
        self.write_batch(WriteBatch(deployments=list(rows)))

    def delete_deployment(self, deployment_id: str) -> bool:
        """Remove a deployment; False when there was none with that id."""
        with self._engine.begin() as conn:
            res = conn.execute(sa.delete(DeploymentRow).where(
                col(DeploymentRow.deployment_id) == deployment_id))
            return bool(res.rowcount)

    def list_deployments(self, model: str | None = None,
                         host_id: str | None = None) -> list[DeploymentRow]:
        q = select(DeploymentRow).order_by(col(DeploymentRow.deployment_id))
        if model is not None:
            q = q.where(DeploymentRow.model == model)
        if host_id is not None:
            q = q.where(DeploymentRow.host_id == host_id)
        with self._session() as s:
            return list(s.exec(q).all())

    # -- rollups -------------------------------------------------------------------------

    def write_rollups(self, rows: Iterable[RollupRow]) -> None:
        """Insert or replace rollups keyed by (model, engine, minute)."""
        self.write_batch(WriteBatch(rollups=list(rows)))

    def rollups(self, model: str | None = None, engine: str | None = None,
                since: datetime | None = None, until: datetime | None = None) -> list[RollupRow]:
        """Rollups with `since` <= minute < `until`, oldest first."""
        q = select(RollupRow).order_by(col(RollupRow.minute), col(RollupRow.model),
                                       col(RollupRow.engine))
        if model is not None:
            q = q.where(RollupRow.model == model)
        if engine is not None:
            q = q.where(RollupRow.engine == engine)
        if since is not None:
            q = q.where(col(RollupRow.minute) >= since)
        if until is not None:
            q = q.where(col(RollupRow.minute) < until)
        with self._session() as s:
            return list(s.exec(q).all())

    # -- command log ---------------------------------------------------------------------

    def log_command(self, command_id: str, host_id: str, epoch: int, kind: str,
                    payload: dict[str, Any], phase: str = "pending",
                    message: str = "") -> CommandLogRow:
        """Record a command sent to an agent; logging the same id again changes nothing."""
        row = CommandLogRow(command_id=command_id, host_id=host_id, epoch=epoch, kind=kind,
                            payload=payload, phase=phase, message=message)
        stmt = dialect_insert(self.dialect, CommandLogRow.__table__)  # type: ignore[attr-defined]
        with self._engine.begin() as conn:
            conn.execute(stmt.on_conflict_do_nothing(index_elements=["command_id"]),
                         [row.model_dump()])
        stored = self.get_command(command_id)
        assert stored is not None
        return stored

    def update_command(self, command_id: str, phase: str, message: str = "") -> bool:
        """Set a command's phase and message; False when the id is unknown."""
        with self._engine.begin() as conn:
            res = conn.execute(sa.update(CommandLogRow)
                               .where(col(CommandLogRow.command_id) == command_id)
                               .values(phase=phase, message=message, updated=utcnow()))
            return bool(res.rowcount)

    def get_command(self, command_id: str) -> CommandLogRow | None:
        with self._session() as s:
            return s.get(CommandLogRow, command_id)

    def list_commands(self, host_id: str | None = None, limit: int = 100) -> list[CommandLogRow]:
        """Newest first."""
        q = (select(CommandLogRow).order_by(col(CommandLogRow.created).desc())
             .limit(positive_limit(limit)))
        if host_id is not None:
            q = q.where(CommandLogRow.host_id == host_id)
        with self._session() as s:
            return list(s.exec(q).all())

    # -- settings ----------------------------------------------------------------------

    def get_setting(self, key: str, default: Any = None) -> Any:
        with self._session() as s:
            row = s.get(SettingRow, key)
            return default if row is None else row.value

    def settings_with_prefix(self, prefix: str) -> dict[str, Any]:
        """Every setting whose key starts with `prefix` (for per-key state such as learned models)."""
        with self._session() as s:
            rows = s.exec(select(SettingRow).where(SettingRow.key.startswith(prefix)))  # type: ignore[attr-defined]
            return {r.key: r.value for r in rows}

    def iter_settings_with_prefix(self, prefix: str) -> Iterator[tuple[str, Any]]:
        """(key, value) of every setting whose key starts with `prefix`, parsed one row at a
        time: a fleet's learned state is loaded without holding all of it twice."""
        table = SettingRow.__table__  # type: ignore[attr-defined]
        query = sa.select(table.c.key, table.c.value).where(table.c.key.startswith(prefix))
        with self._engine.connect() as conn:
            rows = conn.execution_options(yield_per=100).execute(query)
            yield from ((row[0], row[1]) for row in rows)

    def set_setting(self, key: str, value: Any) -> None:
        """Store a JSON value under `key` (known keys must have their documented type)."""
        want = SETTING_TYPES.get(key)
        if want is not None and (not isinstance(value, want)
                                 or (bool not in want and isinstance(value, bool))):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in want)
            raise InvalidArgument(f"setting {key!r} must be {names}, got {value!r}")
        try:
            json.dumps(value)
        except (TypeError, ValueError) as err:
            raise InvalidArgument(f"setting {key!r}: value is not JSON serializable: {err}") from None
        with self._engine.begin() as conn:
            upsert(conn, SettingRow, [{"key": key, "value": value, "updated": utcnow()}],
                         ["key"])

    def set_settings(self, values: dict[str, Any]) -> None:
        """Store several free-form JSON settings in one transaction (learned state)."""
        for key in values:
            if key in SETTING_TYPES:
                raise InvalidArgument(f"setting {key!r} is a known key; use set_setting")
        if not values:
            return
        now = utcnow()
        with self._engine.begin() as conn:
            upsert(conn, SettingRow, [{"key": k, "value": v, "updated": now}
                                            for k, v in values.items()], ["key"])

    def bump_epoch(self) -> int:
        """Atomically increment the fencing epoch and return the new value (1 at first)."""
        with self._session() as s:
            row = s.exec(select(SettingRow).where(SettingRow.key == SETTING_EPOCH)
                         .with_for_update()).first()
            epoch = (int(row.value) if row is not None and row.value is not None else 0) + 1
            if row is None:
                s.add(SettingRow(key=SETTING_EPOCH, value=epoch))
            else:
                row.value = epoch
                row.updated = utcnow()
            s.commit()
            return epoch
