"""Clients among several controllers: address lists, following the leader, the leader gate."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from grpc import aio

from gearshift.common.endpoints import (
    DOWN_FOR_S,
    LEADER_METADATA_KEY,
    ControllerEndpoints,
    leader_hint,
    parse_controllers,
)
from gearshift.common.errors import ConfigError
from gearshift.controller.api.control_service import ControlService
from gearshift.controller.ha.leader import LeaseState
from gearshift.controller.ha.leadership import LeaderGate, Leadership
from gearshift.controller.ingest.fleet import FleetState
from gearshift.v1 import control_pb2, control_pb2_grpc


def test_parse_controllers_accepts_lists_and_names_the_bad_entry() -> None:
    assert parse_controllers("a:1, b:2,a:1") == ["a:1", "b:2"]
    assert parse_controllers(["h:50051"]) == ["h:50051"]
    with pytest.raises(ConfigError, match=r"--controller: expected HOST:PORT, found 'b'"):
        parse_controllers("a:1,b")
    with pytest.raises(ConfigError, match="found 'a:99999'"):
        parse_controllers("a:99999")
    with pytest.raises(ConfigError, match="one or more"):
        parse_controllers(" , ")


class _Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, leader: str | None) -> None:
        self._code, self._leader = code, leader

    def code(self) -> grpc.StatusCode:
        return self._code

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return () if self._leader is None else ((LEADER_METADATA_KEY, self._leader),)


def test_endpoints_follow_a_named_leader_and_pass_over_a_dead_one() -> None:
    now = [0.0]
    ep = ControllerEndpoints("a:1,b:2,c:3", clock=lambda: now[0])
    assert ep.current == "a:1"
    # a follower names the leader: go there at once
    assert ep.failed(_Refusal(grpc.StatusCode.FAILED_PRECONDITION, "c:3")) is True
    assert ep.current == "c:3"
    # the leader dies: next address, after a back-off
    assert ep.failed(_Refusal(grpc.StatusCode.UNAVAILABLE, None)) is False
    assert ep.current == "a:1"
    # a follower still names the dead leader (its lease has not expired): not followed
    assert ep.failed(_Refusal(grpc.StatusCode.FAILED_PRECONDITION, "c:3")) is False
    assert ep.current == "b:2"
    # ... until the address has had time to come back
    now[0] += DOWN_FOR_S + 0.1
    assert ep.failed(_Refusal(grpc.StatusCode.FAILED_PRECONDITION, "c:3")) is True
    assert ep.current == "c:3"


def test_endpoints_follow_a_leader_outside_the_list_and_a_lone_address_stays() -> None:
    ep = ControllerEndpoints("a:1,b:2")
    assert ep.follow("z:9") and ep.current == "z:9"
    ep.failed(_Refusal(grpc.StatusCode.UNAVAILABLE, None))
    assert ep.current in ("a:1", "b:2")
    lone = ControllerEndpoints("a:1")
    lone.failed(_Refusal(grpc.StatusCode.UNAVAILABLE, None))
    assert lone.current == "a:1"
    assert leader_hint(_Refusal(grpc.StatusCode.NOT_FOUND, "x:1")) is None
    assert leader_hint(ValueError()) is None


@dataclass
class FakeElector:
    """What `Leadership` reads of an elector, set by the test."""

    controller_id: str = "me"
    address: str = "127.0.0.1:1"
    leading_epoch: int | None = None
    last_state: LeaseState | None = None
    lead: bool = False

    def may_lead(self) -> bool:
        return self.lead

    def current(self) -> LeaseState | None:
        return self.last_state


@pytest.fixture
async def gated() -> AsyncIterator[tuple[FakeElector, Leadership, str]]:
    elector = FakeElector()
    leadership = Leadership(elector, ha=True, ttl_s=10.0)  # type: ignore[arg-type]
    control = ControlService(FleetState(), controller_id="me", epoch=0, store_kind="postgresql",
                             leadership=lambda: leadership)
    server = aio.server(interceptors=[LeaderGate(lambda: leadership)])
    control_pb2_grpc.add_ControlServiceServicer_to_server(control, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield elector, leadership, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def test_a_follower_refuses_leader_calls_naming_the_leader(
        gated: tuple[FakeElector, Leadership, str]) -> None:
    elector, leadership, addr = gated
    elector.last_state = LeaseState(False, "other", "10.0.0.9:50051", 7, 1.0, 9.0)
    async with aio.insecure_channel(addr) as channel:
        stub = control_pb2_grpc.ControlServiceStub(channel)
        with pytest.raises(aio.AioRpcError) as refused:
            await stub.SetPaused(control_pb2.SetPausedRequest(paused=True))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "the leader is other at 10.0.0.9:50051 (epoch 7)" in refused.value.details()
        assert leader_hint(refused.value) == "10.0.0.9:50051"
        # the status of leadership is answered by any controller
        st = await stub.ControllerStatus(control_pb2.ControllerStatusRequest())
        assert (st.leader, st.leader_id, st.leader_address, st.epoch) == (
            False, "other", "10.0.0.9:50051", 7)
        # nobody leads: refused, and no leader named
        elector.last_state = LeaseState(False, "other", "10.0.0.9:50051", 7, 12.0, -2.0)
        with pytest.raises(aio.AioRpcError) as none:
            await stub.FleetStatus(control_pb2.FleetStatusRequest())
        assert "no controller holds the lease" in none.value.details()
        assert leader_hint(none.value) == ""
        # leading: served
        elector.leading_epoch, elector.lead, leadership.epoch = 8, True, 8
        resp = await stub.FleetStatus(control_pb2.FleetStatusRequest())
        assert resp.controller_id == "me"
        # a leader past its local deadline (paused, resumed) no longer acts
        elector.lead = False
        with pytest.raises(aio.AioRpcError):
            await stub.FleetStatus(control_pb2.FleetStatusRequest())
