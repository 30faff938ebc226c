"""Store fixtures: one contract suite over SQLite (tmp_path) and PostgreSQL (127.0.0.1:5432).

PostgreSQL: trust auth, user ``postgres``; each test module gets its own
uniquely named database, dropped afterwards, and every test starts from an
empty database (rows deleted; `pg_reset(name, drop_schema=True)` leaves no
tables at all). The PostgreSQL params carry ``pytest.mark.postgres`` and are
skipped (with the reason) only when the server cannot be reached.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest

from gearshift.controller.store.database import Store, default_sqlite_url

PG_ADMIN_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres connect_timeout=3"
PG_URL_TEMPLATE = "postgresql+psycopg://postgres@127.0.0.1:5432/{db}"

_pg_unreachable: list[str] = []  # memo of the first failed connect (skip the rest at once)

BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


def _pg_admin() -> psycopg.Connection:
    if _pg_unreachable:
        pytest.skip(_pg_unreachable[0])
    try:
        return psycopg.connect(PG_ADMIN_DSN, autocommit=True)
    except psycopg.OperationalError as err:
        _pg_unreachable.append(f"PostgreSQL not reachable at 127.0.0.1:5432 as postgres: {err}")
        pytest.skip(_pg_unreachable[0])


@pytest.fixture(scope="module")
def pg_database(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh database for this test module; yields its name."""
    module = re.sub(r"[^a-z0-9]+", "_", request.module.__name__.rsplit(".", 1)[-1].lower())
    name = f"gs_{module[:30]}_{uuid.uuid4().hex[:8]}"
    with _pg_admin() as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    yield name
    with _pg_admin() as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def pg_reset(name: str, *, drop_schema: bool = False) -> None:
    """Empty database `name`: delete every row (fast), or drop every table."""
    dsn = PG_ADMIN_DSN.replace("dbname=postgres", f"dbname={name}")
    with psycopg.connect(dsn, autocommit=True) as conn:
        if drop_schema:
            conn.execute("DROP SCHEMA public CASCADE")
            conn.execute("CREATE SCHEMA public")
            return
        tables = [r[0] for r in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
            " AND tablename <> 'alembic_version'")]
        with conn.transaction():  # DELETE beats TRUNCATE on tables this small
            for table in tables:
                conn.execute(f'DELETE FROM "{table}"')


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path) -> str:  # type: ignore[no-untyped-def]
    """A URL of an empty database of each backend."""
    if request.param == "sqlite":
        return default_sqlite_url(tmp_path / "data")
    name = request.getfixturevalue("pg_database")
    pg_reset(name)
    return PG_URL_TEMPLATE.format(db=name)


@pytest.fixture
def open_store(store_url: str) -> Iterator[Callable[[], Store]]:
    """Opens (more) stores on `store_url`, all closed after the test."""
    opened: list[Store] = []

    def _open() -> Store:
        s = Store.open(store_url)
        opened.append(s)
        return s

    yield _open
    for s in opened:
        s.close()


@pytest.fixture
def store(open_store: Callable[[], Store]) -> Store:
    return open_store()
