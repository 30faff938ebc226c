"""/readyz says not ready while the store refuses writes, naming the cause, and ready
again once it takes them (SQLite's own "database or disk is full", from a page cap)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import sqlalchemy as sa

from gearshift.controller.server import Controller
from gearshift.controller.store.tables import HostRow

WAIT_LIMIT_S = 30.0


async def _until(cond: Any) -> None:
    deadline = time.monotonic() + WAIT_LIMIT_S
    while not cond():
        assert time.monotonic() < deadline, "condition never became true"
        await asyncio.sleep(0.05)


async def test_readyz_is_not_ready_while_the_store_refuses_writes(controller: Controller) -> None:
    assert controller.readiness()[0]
    store = controller.persistence.store
    with store.engine.connect() as conn:
        pages = int(conn.exec_driver_sql("PRAGMA page_count").scalar() or 0)

    def cap(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.execute(f"PRAGMA max_page_count = {pages}")

    sa.event.listen(store.engine, "connect", cap)
    store.engine.dispose()
    writer = controller.persistence.writer
    for i in range(2000):
        writer.submit_host(HostRow(host_id=f"h-{i:05d}-" + "x" * 200, agent_version="1"))
    await _until(lambda: not controller.readiness()[0])
    assert controller.readiness() == (False, "the store refuses writes: disk full")

    sa.event.remove(store.engine, "connect", cap)
    store.engine.dispose()
    await _until(lambda: controller.readiness()[0])
