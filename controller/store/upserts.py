"""Rows as plain dicts and their batched upserts (SQLAlchemy Core), for the batching writer.

The ingest path produces rows at fleet rate; building and dumping a SQLModel
object per row costs an order of magnitude more than a dict of column values,
so the writer keeps dicts and commits them with one Core ``INSERT … ON
CONFLICT`` per table (executemany). `TableSpec` knows, per table, the row's key,
which columns an update leaves alone, and the column defaults (the SQLModel
fields' defaults, filled in on the writer thread, not on the event loop).
SQLModel rows are still accepted and dumped. `dialect_insert`, `upsert` and
`positive_limit` are the pieces every repository of the store's engine shares (the
`Store`, the `DecisionStore`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from pydantic_core import PydanticUndefined
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlmodel import SQLModel

from gearshift.common.errors import InvalidArgument
from gearshift.controller.store.tables import (
    CommandLogRow,
    DeploymentRow,
    HostRow,
    RevisionRow,
    RollupRow,
)

Values = dict[str, Any]


def dialect_insert(dialect: str, table: sa.Table) -> Any:
    """An ``INSERT`` on `table` with the dialect's ``ON CONFLICT`` clauses."""
    return (postgresql.insert if dialect == "postgresql" else sqlite.insert)(table)


def upsert(conn: Connection, model: type[SQLModel], rows: list[dict[str, Any]],
           keys: Sequence[str], keep: Sequence[str] = ()) -> None:
    """INSERT rows, or on a key conflict update every column but `keys` and `keep`."""
    if not rows:
        return
    table: sa.Table = model.__table__  # type: ignore[attr-defined]
    stmt = dialect_insert(conn.dialect.name, table)
    update = {c.name: stmt.excluded[c.name] for c in table.columns
              if c.name not in keys and c.name not in keep}
    conn.execute(stmt.on_conflict_do_update(index_elements=list(keys), set_=update), rows)


def positive_limit(limit: int) -> int:
    """`limit` when it is a positive integer; InvalidArgument otherwise."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidArgument(f"limit must be a positive integer, got {limit!r}")
    return limit


class TableSpec:
    """How the writer stores rows of one table."""

    def __init__(self, kind: str, model: type[SQLModel], keys: Sequence[str],
                 keep: Sequence[str] | None, generated: Sequence[str] = ()) -> None:
        """`kind` labels metrics and logs; `keep`: columns an update leaves alone, or None
        when a conflicting row is left as it is (insert only); `generated`: columns the
        database fills in (never written)."""
        self.kind = kind
        self.model = model
        self.table: sa.Table = model.__table__  # type: ignore[attr-defined]
        self.keys = tuple(keys)
        self.keep = None if keep is None else tuple(keep)
        self.generated = frozenset(generated)
        self.columns = frozenset(c.name for c in self.table.columns) - self.generated
        self._defaults: dict[str, Callable[[], Any]] = {}
        self._required: frozenset[str] = frozenset()
        required = set()
        for name, info in model.model_fields.items():
            if name not in self.columns:
                continue
            if info.default_factory is not None:
                self._defaults[name] = info.default_factory  # type: ignore[assignment]
            elif info.default is not PydanticUndefined:
                self._defaults[name] = (lambda v: lambda: v)(info.default)
            else:
                required.add(name)
        self._required = frozenset(required)
        self._statements: dict[str, Any] = {}

    def values(self, row: SQLModel | Mapping[str, Any]) -> Values:
        """A row's column values (a copy). ValueError names what a dict row gets wrong."""
        if isinstance(row, SQLModel):
            return {k: v for k, v in row.model_dump().items() if k not in self.generated}
        values = dict(row)
        if not self.columns.issuperset(values) or not self._required.issubset(values):
            unknown = sorted(set(values) - self.columns)
            missing = sorted(self._required - set(values))
            raise ValueError(f"{self.kind} row for table {self.table.name!r}: "
                             f"unknown columns {unknown}, missing columns {missing}")
        return values

    def key(self, values: Values) -> Hashable:
        if len(self.keys) == 1:
            return values[self.keys[0]]
        return tuple(values[k] for k in self.keys)

    def complete(self, values: Values) -> Values:
        """Every column present (executemany needs the same keys in every row)."""
        if len(values) == len(self.columns):
            return values
        full = {name: make() for name, make in self._defaults.items() if name not in values}
        full.update(values)
        return full

    def _statement(self, dialect: str) -> Any:
        stmt = self._statements.get(dialect)
        if stmt is None:
            insert = dialect_insert(dialect, self.table)
            if self.keep is None:
                stmt = insert.on_conflict_do_nothing(index_elements=list(self.keys))
            else:
                update = {c.name: insert.excluded[c.name] for c in self.table.columns
                          if c.name in self.columns and c.name not in self.keys
                          and c.name not in self.keep}
                stmt = insert.on_conflict_do_update(index_elements=list(self.keys), set_=update)
            self._statements[dialect] = stmt
        return stmt

    def write(self, conn: Connection, rows: list[Values], deleted: list[Hashable]) -> None:
        """Upsert `rows` and delete the rows keyed `deleted` (single-key tables only)."""
        if rows:
            conn.execute(self._statement(conn.dialect.name), [self.complete(r) for r in rows])
        if deleted:
            (key,) = self.keys
            conn.execute(sa.delete(self.table).where(self.table.c[key].in_(deleted)))


HOSTS = TableSpec("host", HostRow, ["host_id"], keep=["first_seen"])
DEPLOYMENTS = TableSpec("deployment", DeploymentRow, ["deployment_id"], keep=[])
ROLLUPS = TableSpec("rollup", RollupRow, ["model", "engine", "minute"], keep=[])
COMMANDS = TableSpec("command", CommandLogRow, ["command_id"],
                     keep=["created", "host_id", "epoch", "kind", "payload"])
REVISIONS = TableSpec("revision", RevisionRow, ["model", "revision"], keep=None,
                      generated=["id"])
# Commit order within one transaction.
SPECS = (HOSTS, DEPLOYMENTS, ROLLUPS, COMMANDS, REVISIONS)
