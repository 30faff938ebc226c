"""The agent stream as a misbehaving or silent agent sees it: a real controller
in this process, raw gRPC clients over loopback."""

from __future__ import annotations

import asyncio
import math

import grpc
from grpc import aio

from gearshift.controller.server import Controller
from gearshift.v1 import agent_pb2, agent_pb2_grpc, control_pb2, control_pb2_grpc


def hello(host_id: str = "h1", version: int = agent_pb2.PROTOCOL_VERSION_1) -> agent_pb2.AgentMessage:
    return agent_pb2.AgentMessage(hello=agent_pb2.Hello(
        host_id=host_id, agent_version="test", protocol_version=version))  # type: ignore[arg-type]


def report(seq: int, rate: float = 1.0) -> agent_pb2.AgentMessage:
    r = agent_pb2.Report(seq=seq)
    r.deployments.add(deployment_id="d1", engine="vllm", model="m", request_rate=rate,
                      phase=agent_pb2.DEPLOYMENT_PHASE_READY, endpoint="http://127.0.0.1:1")
    return agent_pb2.AgentMessage(report=r)


async def open_stream(ctl: Controller) -> tuple[aio.Channel, aio.StreamStreamCall]:
    channel = aio.insecure_channel(f"127.0.0.1:{ctl.port}")
    return channel, agent_pb2_grpc.AgentServiceStub(channel).Connect()


async def hosts(ctl: Controller) -> dict[str, control_pb2.Host]:
    async with aio.insecure_channel(f"127.0.0.1:{ctl.port}") as ch:
        resp = await control_pb2_grpc.ControlServiceStub(ch).ListHosts(control_pb2.ListHostsRequest())
    return {h.host_id: h for h in resp.hosts}


async def expect_status(call: aio.StreamStreamCall) -> tuple[grpc.StatusCode, str]:
    try:
        while await call.read() is not aio.EOF:
            pass
    except grpc.RpcError:
        pass  # the status is read below
    return await call.code(), await call.details()


async def test_wrong_protocol_version_is_refused_clearly(controller: Controller) -> None:
    channel, call = await open_stream(controller)
    async with channel:
        await call.write(hello(version=7))
        code, details = await expect_status(call)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "protocol_version" in details and "found 7" in details
    assert await hosts(controller) == {}


async def test_report_before_hello_is_refused(controller: Controller) -> None:
    channel, call = await open_stream(controller)
    async with channel:
        await call.write(report(1))
        code, details = await expect_status(call)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "first message must be a hello" in details


async def test_bad_report_disconnects_only_that_agent(controller: Controller) -> None:
    ch_good, good = await open_stream(controller)
    ch_bad, bad = await open_stream(controller)
    async with ch_good, ch_bad:
        await good.write(hello("good"))
        await bad.write(hello("bad"))
        assert (await good.read()).WhichOneof("body") == "welcome"
        assert (await bad.read()).WhichOneof("body") == "welcome"
        await bad.write(report(1, rate=math.nan))
        code, details = await expect_status(bad)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "report.deployments[0].request_rate" in details and "nan" in details
        # The other agent is undisturbed: its reports are still acknowledged.
        for seq in (1, 2):
            await good.write(report(seq))
            ack = await good.read()
            assert ack.WhichOneof("body") == "ack" and ack.ack.seq == seq
    known = await hosts(controller)
    assert known["good"].reports == 2
    assert known["bad"].reports == 0  # nothing of the bad report was applied


async def test_oversized_message_is_refused(controller: Controller) -> None:
    channel, call = await open_stream(controller)
    async with channel:
        await call.write(hello("big"))
        await call.read()
        msg = report(1)
        msg.report.deployments[0].message = "x" * (5 * 1024 * 1024)
        await call.write(msg)
        code, _ = await expect_status(call)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (await hosts(controller))["big"].reports == 0


async def test_duplicate_report_is_acked_but_applied_once(controller: Controller) -> None:
    channel, call = await open_stream(controller)
    async with channel:
        await call.write(hello("dup"))
        await call.read()
        for seq in (1, 1, 2):
            await call.write(report(seq))
            assert (await call.read()).ack.seq == seq
    assert (await hosts(controller))["dup"].reports == 2


async def test_silent_host_becomes_unreachable_and_nothing_is_done(controller: Controller) -> None:
    channel, call = await open_stream(controller)
    async with channel:
        await call.write(hello("quiet"))
        await call.read()
        await call.write(report(1))
        await call.read()
        assert (await hosts(controller))["quiet"].state == control_pb2.HOST_STATE_CONNECTED
        await asyncio.sleep(3 * 0.2 + 0.3)  # three report intervals missed
        h = (await hosts(controller))["quiet"]
        assert h.state == control_pb2.HOST_STATE_UNREACHABLE
        # Unknown is not a reason to act: its deployment is still listed and routed.
        assert h.deployments == 1
        table = controller.fleet.routing_table()
        assert [e.deployment_id for m in table.models for e in m.endpoints] == ["d1"]
        call.cancel()


async def test_commands_reach_an_idle_agent_in_order_before_a_controller_close(
        controller: Controller) -> None:
    # Commands queued while the agent sends nothing are written at once, in order, and a
    # close by the controller ends the stream with its status only after them.
    channel, call = await open_stream(controller)
    async with channel:
        await call.write(hello("h1"))
        assert (await call.read()).HasField("welcome")
        await call.write(report(1))
        assert (await call.read()).ack.seq == 1
        assert controller.agents.send_command("h1", agent_pb2.Command(command_id="c1"))
        got = await asyncio.wait_for(call.read(), 5.0)
        assert got.command.command_id == "c1"
        conn = controller.agents.connections["h1"]
        assert conn.send(agent_pb2.ControllerMessage(command=agent_pb2.Command(command_id="c2")))
        assert conn.send(agent_pb2.ControllerMessage(command=agent_pb2.Command(command_id="c3")))
        conn.close(grpc.StatusCode.PERMISSION_DENIED, "host h1 is revoked")
        assert not conn.send(agent_pb2.ControllerMessage(command=agent_pb2.Command(command_id="c4")))
        ids = [(await call.read()).command.command_id for _ in range(2)]
        assert ids == ["c2", "c3"]
        code, details = await asyncio.wait_for(expect_status(call), 5.0)
    assert code == grpc.StatusCode.PERMISSION_DENIED and details == "host h1 is revoked"
    assert "h1" not in controller.agents.connections
