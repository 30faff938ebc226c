"""Times in `gearshift migrations show | list`: only the times a migration has (no
`finished` for a move still running, never an unset Timestamp as 1970 or as now)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
from click.testing import CliRunner, Result
from google.protobuf.timestamp_pb2 import Timestamp
from grpc import aio

from gearshift.cli.explain import migration_times
from gearshift.cli.main import cli
from gearshift.cli.migrations import show_report
from gearshift.cli.output import times_line, timestamp_text
from gearshift.v1 import control_pb2, control_pb2_grpc

CREATED = datetime(2026, 12, 6, 10, 0, 0, tzinfo=UTC)
UPDATED = datetime(2026, 12, 6, 10, 2, 30, tzinfo=UTC)
FINISHED = datetime(2026, 12, 6, 10, 5, 0, tzinfo=UTC)


def ts(when: datetime) -> Timestamp:
    out = Timestamp()
    out.FromDatetime(when)
    return out


def migration(**overrides: Any) -> control_pb2.Migration:
    fields: dict[str, Any] = dict(
        id="mig-1", model="llama-3.3-70b", from_engine="vllm", to_engine="tensorrt-llm",
        kind="engine_switch", phase="starting", created_at=ts(CREATED), updated_at=ts(UPDATED),
        steps=[control_pb2.MigrationStep(at=ts(CREATED), to_phase="pending", message="created")])
    fields.update(overrides)
    return control_pb2.Migration(**fields)


def test_unset_timestamp_has_no_text() -> None:
    assert timestamp_text(Timestamp()) is None
    assert timestamp_text(ts(FINISHED)) == "2026-12-06 10:05:00Z"
    assert times_line([("created", ts(CREATED)), ("finished", Timestamp())]) \
        == "created 2026-12-06 10:00:00Z"
    assert times_line([("finished", Timestamp())]) == ""


def test_running_migration_shows_no_finish_time() -> None:
    m = migration()
    assert migration_times(m) == "created 2026-12-06 10:00:00Z, updated 2026-12-06 10:02:30Z"
    report = show_report(m)
    assert "finished" not in report
    assert "1970" not in report
    assert "  created 2026-12-06 10:00:00Z, updated 2026-12-06 10:02:30Z" in report.splitlines()
    # A finish time sent for a move still running (a controller bug) is not shown either.
    assert "finished" not in show_report(migration(finished_at=ts(FINISHED)))


def test_ended_migration_shows_its_finish_time() -> None:
    m = migration(phase="done", updated_at=ts(FINISHED), finished_at=ts(FINISHED))
    assert migration_times(m) == "created 2026-12-06 10:00:00Z, finished 2026-12-06 10:05:00Z"
    assert "finished 2026-12-06 10:05:00Z" in show_report(m)


class Migrations(control_pb2_grpc.ControlServiceServicer):
    def __init__(self, *migrations: control_pb2.Migration) -> None:
        self.by_id = {m.id: m for m in migrations}

    async def GetMigration(self, request: Any, context: Any) -> Any:
        return self.by_id[request.id]

    async def ListMigrations(self, request: Any, context: Any) -> Any:
        return control_pb2.ListMigrationsResponse(migrations=list(self.by_id.values()))


@pytest.fixture
async def controller_addr() -> AsyncIterator[str]:
    server = aio.server()
    control_pb2_grpc.add_ControlServiceServicer_to_server(Migrations(
        migration(), migration(id="mig-2", phase="rolled_back", finished_at=ts(FINISHED))), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def _run(args: list[str]) -> Result:
    return CliRunner().invoke(cli, args, catch_exceptions=False, env={
        "GEARSHIFT_TLS_CA": "", "GEARSHIFT_TOKEN": "", "GEARSHIFT_TOKEN_FILE": ""})


async def test_cli_show_and_list_print_only_set_times(controller_addr: str) -> None:
    out = await asyncio.to_thread(_run, ["--controller", controller_addr, "migrations",
                                         "show", "mig-1"])
    assert out.exit_code == 0, out.output
    assert "created 2026-12-06 10:00:00Z, updated 2026-12-06 10:02:30Z" in out.output
    assert "finished" not in out.output and "1970" not in out.output
    out = await asyncio.to_thread(_run, ["--controller", controller_addr, "migrations",
                                         "show", "mig-2"])
    assert "finished 2026-12-06 10:05:00Z" in out.output
    out = await asyncio.to_thread(_run, ["--controller", controller_addr, "migrations", "list"])
    assert out.exit_code == 0, out.output
    assert "2026-12-06 10:00:00Z" in out.output and "1970" not in out.output
