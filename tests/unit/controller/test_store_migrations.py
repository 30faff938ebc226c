"""Opening stores: migrations (idempotent, matching the models), WAL, URL errors."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlmodel import SQLModel

from gearshift.common.errors import ConfigError, Unavailable
from gearshift.controller.store.database import Store, alembic_config, default_sqlite_url
from gearshift.controller.store.tables import HostRow

from .conftest import PG_URL_TEMPLATE, pg_reset

TABLES = {"hosts", "deployments", "rollups", "command_log", "policy_versions", "settings",
          "decisions", "revisions", "bootstrap_tokens", "host_enrolments"}


def _head() -> str:
    with sa.create_engine("sqlite://").connect() as conn:
        head = ScriptDirectory.from_config(alembic_config(conn)).get_current_head()
    assert head is not None
    return head


def _engine(url: str) -> sa.Engine:
    return sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://"))


def test_open_from_scratch_creates_every_table_at_head(store_url: str) -> None:
    if store_url.startswith("postgresql"):
        pg_reset(store_url.rsplit("/", 1)[1], drop_schema=True)
    Store.open(store_url).close()
    engine = _engine(store_url)
    try:
        with engine.connect() as conn:
            assert set(sa.inspect(conn).get_table_names()) >= TABLES
            assert MigrationContext.configure(conn).get_current_revision() == _head()
    finally:
        engine.dispose()


def test_open_twice_is_idempotent_and_keeps_data(open_store) -> None:  # type: ignore[no-untyped-def]
    first = open_store()
    first.upsert_hosts([HostRow(host_id="h1")])
    second = open_store()
    assert [h.host_id for h in second.list_hosts()] == ["h1"]
    open_store()  # a third time, still fine


def test_migration_matches_the_models(store: Store, store_url: str) -> None:
    engine = _engine(store_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), SQLModel.metadata)
    finally:
        engine.dispose()
    assert diff == []


def test_downgrade_to_base_and_up_again(store: Store, store_url: str) -> None:
    engine = _engine(store_url)
    try:
        with engine.begin() as conn:
            command.downgrade(alembic_config(conn), "base")
        with engine.connect() as conn:
            assert not TABLES & set(sa.inspect(conn).get_table_names())
    finally:
        engine.dispose()
    Store.open(store_url).close()


def test_sqlite_runs_in_wal_mode(tmp_path: Path) -> None:
    url = default_sqlite_url(tmp_path / "nested" / "data")
    assert url == f"sqlite:///{tmp_path / 'nested' / 'data' / 'gearshift.db'}"
    store = Store.open(url)
    try:
        store.upsert_hosts([HostRow(host_id="h1")])
        with sqlite3.connect(tmp_path / "nested" / "data" / "gearshift.db") as raw:
            assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert raw.execute("SELECT host_id FROM hosts").fetchall() == [("h1",)]
    finally:
        store.close()


def test_sqlite_in_memory_works_for_quick_use() -> None:
    store = Store.open("sqlite://")
    try:
        store.upsert_hosts([HostRow(host_id="h1")])
        assert [h.host_id for h in store.list_hosts()] == ["h1"]
    finally:
        store.close()


@pytest.mark.parametrize("url, scheme", [
    ("mysql://root:s3cret@db.example/gs", "mysql"),
    ("postgresql+psycopg2://u:s3cret@h/db", "postgresql+psycopg2"),
    ("redis://:s3cret@localhost", "redis"),
])
def test_unsupported_url_names_scheme_and_supported_ones(url: str, scheme: str) -> None:
    with pytest.raises(ConfigError) as err:
        Store.open(url)
    assert repr(scheme) in err.value.message
    assert "sqlite:///PATH" in err.value.message and "postgresql+psycopg://" in err.value.message
    assert "s3cret" not in err.value.message


def test_garbage_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not a valid URL"):
        Store.open("just some words")


@pytest.mark.postgres
def test_unreachable_postgres_is_unavailable_without_password() -> None:
    with pytest.raises(Unavailable) as err:
        Store.open("postgresql+psycopg://postgres:s3cret@127.0.0.1:1/nodb?connect_timeout=2")
    assert "127.0.0.1:1/nodb" in err.value.message
    assert "s3cret" not in err.value.message


@pytest.mark.postgres
def test_controllers_starting_together_migrate_once(pg_database: str) -> None:
    """Several controllers of one HA group open a fresh database at the same moment:
    one migrates while the others wait, and every one ends up at head."""
    from concurrent.futures import ThreadPoolExecutor

    pg_reset(pg_database, drop_schema=True)
    url = PG_URL_TEMPLATE.format(db=pg_database)
    with ThreadPoolExecutor(4) as pool:
        stores = list(pool.map(lambda _i: Store.open(url), range(4)))
    try:
        with _engine(url).connect() as conn:
            assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars() \
                .all() == [_head()]
    finally:
        for s in stores:
            s.close()
