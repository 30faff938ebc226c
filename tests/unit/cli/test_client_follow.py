"""The CLI given several controllers follows a follower's refusal to the leader."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import click
import pytest
from click.testing import CliRunner
from grpc import aio

from gearshift.cli.main import cli
from gearshift.controller.api.control_service import ControlService
from gearshift.controller.ha.leader import LeaseState
from gearshift.controller.ha.leadership import LeaderGate, Leadership
from gearshift.controller.ingest.fleet import FleetState
from gearshift.v1 import control_pb2_grpc


class Elector:
    def __init__(self, controller_id: str, address: str, lead: bool) -> None:
        self.controller_id, self.address, self.lead = controller_id, address, lead
        self.leading_epoch: int | None = 3 if lead else None
        self.last_state: LeaseState | None = None

    def may_lead(self) -> bool:
        return self.lead

    def current(self) -> LeaseState | None:
        return self.last_state


async def _serve(controller_id: str, lead: bool, leader_addr: str = "",
                 ) -> tuple[aio.Server, str, Elector]:
    elector = Elector(controller_id, "", lead)
    leadership = Leadership(elector, ha=True, ttl_s=10.0)  # type: ignore[arg-type]
    if lead:
        leadership.epoch = 3
    control = ControlService(FleetState(), controller_id=controller_id, epoch=3,
                             store_kind="postgresql", leadership=lambda: leadership)
    server = aio.server(interceptors=[LeaderGate(lambda: leadership)])
    control_pb2_grpc.add_ControlServiceServicer_to_server(control, server)
    port = server.add_insecure_port("127.0.0.1:0")
    elector.address = f"127.0.0.1:{port}"
    await server.start()
    return server, elector.address, elector


@pytest.fixture
async def pair() -> AsyncIterator[tuple[str, str, Elector]]:
    leader, leader_addr, _ = await _serve("lead", True)
    follower, follower_addr, fel = await _serve("follow", False)
    fel.last_state = LeaseState(False, "lead", leader_addr, 3, 0.5, 9.5)
    try:
        yield follower_addr, leader_addr, fel
    finally:
        await follower.stop(0)
        await leader.stop(0)


def _run(args: list[str]) -> click.testing.Result:
    return CliRunner().invoke(cli, args, catch_exceptions=False)


async def test_cli_follows_the_follower_to_the_leader(pair: tuple[str, str, Elector]) -> None:
    follower, leader, fel = pair
    out = await asyncio.to_thread(_run, ["--controller", f"{follower},{leader}", "fleet",
                                         "status", "-o", "json"])
    assert out.exit_code == 0, out.output
    assert '"controller_id": "lead"' in out.output
    # Only the follower given, the leader outside the list: followed all the same.
    out = await asyncio.to_thread(_run, ["--controller", follower, "fleet", "status"])
    assert out.exit_code == 0 and "lead" in out.output
    # Nobody leads: a clear refusal, exit code 4 (FAILED_PRECONDITION).
    fel.last_state = LeaseState(False, "lead", leader, 3, 20.0, -10.0)
    out = await asyncio.to_thread(_run, ["--controller", follower, "fleet", "status"])
    assert out.exit_code == 4
    assert "no controller holds the lease" in out.output


async def test_controller_status_lists_every_controller(pair: tuple[str, str, Elector]) -> None:
    follower, leader, _ = pair
    out = await asyncio.to_thread(_run, ["--controller", f"{follower},127.0.0.1:1", "controller",
                                         "status"])
    assert out.exit_code == 0, out.output
    assert "follower" in out.output and "unreachable" in out.output
    assert f"lead at {leader}" in out.output


def test_bad_controller_list_is_refused_by_name() -> None:
    out = _run(["--controller", "a:1,nope", "fleet", "status"])
    assert out.exit_code == 2
    assert "expected HOST:PORT, found 'nope'" in out.output
