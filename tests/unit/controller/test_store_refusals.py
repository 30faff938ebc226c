"""A full or failing store says so in one line naming its cause, counts it, and the
controller's /readyz is not ready while writes fail.

The full disk is SQLite's own: `PRAGMA max_page_count` caps the file, and SQLite then
answers every write that needs one page more with "database or disk is full", as it
does on a full file system."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import sqlalchemy as sa
from grpc import aio
from prometheus_client import CollectorRegistry

from gearshift.controller.api.interceptors import ErrorInterceptor
from gearshift.controller.store.database import Store
from gearshift.controller.store.errors import store_cause
from gearshift.controller.store.tables import HostRow
from gearshift.controller.store.writer import BatchingWriter

WAIT_LIMIT_S = 30.0


def _cap_pages(engine: sa.engine.Engine, pages: int) -> Callable[[Any, Any], None]:
    """Every new connection of `engine` may grow the file to `pages` pages; returns the
    listener (remove it to lift the cap)."""
    def cap(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.execute(f"PRAGMA max_page_count = {pages}")
    sa.event.listen(engine, "connect", cap)
    engine.dispose()
    return cap


def _wait(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_LIMIT_S
    while not cond():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.02)


def test_a_full_store_is_named_counted_and_then_recovers(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    store = Store.open(f"sqlite:///{tmp_path / 'gs.db'}")
    registry = CollectorRegistry()
    writer = BatchingWriter(store, flush_interval_s=0.05, registry=registry)
    try:
        with store.engine.connect() as conn:
            pages = int(conn.exec_driver_sql("PRAGMA page_count").scalar() or 0)
        cap = _cap_pages(store.engine, pages)  # not one page more
        for i in range(2000):
            writer.submit_host(HostRow(host_id=f"host-{i:05d}-" + "x" * 200, agent_version="1"))
        _wait(lambda: writer.failing is not None)
        assert writer.failing == "disk full"
        assert registry.get_sample_value("gearshift_store_writes_failing") == 1.0
        assert (registry.get_sample_value("gearshift_store_refusals_total",
                                          {"cause": "disk full"}) or 0) >= 1
        said = [r.getMessage() for r in caplog.records if "refused the write" in r.getMessage()]
        assert said == ["the store refused the write: disk full"]  # once, in one line
        assert not any(r.exc_info for r in caplog.records)

        sa.event.remove(store.engine, "connect", cap)
        store.engine.dispose()
        _wait(lambda: writer.failing is None)
        assert registry.get_sample_value("gearshift_store_writes_failing") == 0.0
        assert writer.flush(WAIT_LIMIT_S)
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT count(*) FROM hosts").scalar() == 2000
    finally:
        writer.close(5)
        store.close()


@pytest.mark.parametrize(("message", "cause"), [
    ("(sqlite3.OperationalError) database or disk is full", "disk full"),
    ('could not extend file "base/16384/2619": No space left on device', "disk full"),
    ("(sqlite3.OperationalError) attempt to write a readonly database", "read-only store"),
    ("(sqlite3.OperationalError) database is locked", "store locked"),
    ("(psycopg.OperationalError) connection failed: Connection refused", "store unreachable"),
    ("(sqlite3.OperationalError) something new\nwith a second line", "(sqlite3.OperationalError) "
                                                                      "something new"),
])
def test_the_cause_is_named_in_a_few_words(message: str, cause: str) -> None:
    assert store_cause(sa.exc.OperationalError("INSERT", {}, Exception(message))) == \
        cause or store_cause(Exception(message)) == cause


async def test_a_call_the_store_refuses_answers_unavailable_in_one_line() -> None:
    async def apply(request: bytes, context: Any) -> bytes:
        raise sa.exc.OperationalError("INSERT INTO policy_versions", {},
                                      Exception("database or disk is full"))

    handler = grpc.unary_unary_rpc_method_handler(apply)
    server = aio.server(interceptors=[ErrorInterceptor()])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {"A": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(aio.AioRpcError) as err:
                await channel.unary_unary("/t.T/A")(b"", timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details() == "the store refused the write: disk full"
    finally:
        await server.stop(0)
