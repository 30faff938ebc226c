"""Agent reports from a newer, a broken or a hostile agent: a real controller in this
process, raw gRPC clients over loopback, the real CLI as a child process."""

from __future__ import annotations

import asyncio
import math
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc import aio

from gearshift.controller.server import HOUSEKEEPING_INTERVAL_S, Controller, ControllerConfig
from gearshift.v1 import agent_pb2, agent_pb2_grpc, control_pb2, control_pb2_grpc

NEWER_PHASE = 42  # a DeploymentPhase value this controller's proto does not have


@pytest.fixture
async def controller(tmp_path: Path) -> AsyncIterator[Controller]:
    ctl = Controller(ControllerConfig(listen="127.0.0.1:0", data_dir=tmp_path / "data",
                                      report_interval_s=0.2, metrics_port=0))
    await ctl.start()
    try:
        yield ctl
    finally:
        await ctl.stop(0.1)


def hello(host_id: str, token: str = "") -> agent_pb2.AgentMessage:
    return agent_pb2.AgentMessage(hello=agent_pb2.Hello(
        host_id=host_id, agent_version="test", protocol_version=agent_pb2.PROTOCOL_VERSION_1,
        session_token=token))


def report(seq: int, **fields: object) -> agent_pb2.AgentMessage:
    r = agent_pb2.Report(seq=seq, interval_s=0.2)
    dep = {"deployment_id": "d1", "engine": "vllm", "model": "m", "request_rate": 1.0,
           "phase": agent_pb2.DEPLOYMENT_PHASE_READY, "endpoint": "http://127.0.0.1:8000",
           "metrics_present": True, **fields}
    r.deployments.add(**dep)  # type: ignore[arg-type]
    return agent_pb2.AgentMessage(report=r)


async def connect(ctl: Controller, host_id: str, token: str = ""
                  ) -> tuple[aio.Channel, aio.StreamStreamCall, agent_pb2.Welcome]:
    channel = aio.insecure_channel(f"127.0.0.1:{ctl.port}")
    call = agent_pb2_grpc.AgentServiceStub(channel).Connect()
    await call.write(hello(host_id, token))
    first = await call.read()
    return channel, call, first.welcome


async def status_of(call: aio.StreamStreamCall) -> tuple[grpc.StatusCode, str]:
    try:
        while await call.read() is not aio.EOF:
            pass
    except grpc.RpcError:
        pass
    return await call.code(), await call.details()


async def refused(ctl: Controller, msg: agent_pb2.AgentMessage) -> str:
    channel, call, _ = await connect(ctl, "hostile")
    async with channel:
        await call.write(msg)
        code, details = await status_of(call)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert ctl.fleet.hosts["hostile"].reports == 0  # nothing of it was applied
    return details


async def test_an_unknown_phase_is_shown_as_unknown_and_upkeep_goes_on(
        controller: Controller) -> None:
    channel, call, _ = await connect(controller, "newer")
    async with channel:
        await call.write(report(1, phase=NEWER_PHASE))
        assert (await call.read()).ack.seq == 1
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gearshift.cli.main", "--controller",
            f"127.0.0.1:{controller.port}", "fleet", "deployments",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        assert "unknown" in out.decode() and "Traceback" not in err.decode()
        await asyncio.sleep(HOUSEKEEPING_INTERVAL_S + 1.0)  # one housekeeping pass
        url = f"http://127.0.0.1:{controller.metrics_port}/metrics"
        text = (await asyncio.to_thread(urllib.request.urlopen, url, timeout=10)).read().decode()
        assert 'phase="unknown"' in text
        call.cancel()


@pytest.mark.parametrize(("fields", "where"), [
    ({"request_rate": 1e300}, "request_rate (1 GPU)"),
    ({"request_rate": 20_001.0, "tensor_parallel_size": 2}, "request_rate (2 GPUs)"),
    ({"kv_cache_usage": 1.5}, "kv_cache_usage"),
    ({"prefix_cache_hit_rate": 1.5}, "prefix_cache_hit_rate"),
    ({"kv_blocks_total": 10, "kv_blocks_used": 11}, "kv_blocks_used"),
    ({"endpoint": "javascript:alert(1)"}, "endpoint"),
    ({"endpoint": "http://10.9.8.7:8000"}, "not the address this host connects from"),
    ({"endpoint": "http://user:pw@127.0.0.1:8000"}, "no credentials"),
    ({"endpoint": "http://127.0.0.1:8000/x?y"}, "no path"),
    ({"endpoint": "http://127.0.0.1:99999"}, "endpoint"),
    ({"engine_version": "0.11\x1b[2J"}, "engine_version: expected a version"),
    ({"engine_release": "r" * 10_000}, "engine_release: expected a version"),
    ({"engine_version_match": 42}, "engine_version_match: expected one of VERSION_MATCH_"),
])
async def test_implausible_deployment_fields_are_refused(controller: Controller,
                                                         fields: dict[str, object],
                                                         where: str) -> None:
    details = await refused(controller, report(1, **fields))
    assert where in details
    assert not any(e.endpoint != "http://127.0.0.1:8000"
                   for m in controller.fleet.routing_table().models for e in m.endpoints)


@pytest.mark.parametrize(("field", "value"), [
    ("utilization", math.nan), ("utilization", 1.5), ("temperature_c", math.inf),
    ("power_w", -1.0), ("memory_used_bytes", 10**12)])
async def test_implausible_gpu_figures_are_refused(controller: Controller, field: str,
                                                   value: float) -> None:
    msg = report(1)
    msg.report.gpus.add(index=0, memory_total_bytes=80 << 30, **{field: value})
    assert f"report.gpus[0].{field}" in await refused(controller, msg)


@pytest.mark.parametrize("interval_s", [math.nan, math.inf, -1.0, 1e12])
async def test_an_implausible_interval_is_refused(controller: Controller,
                                                  interval_s: float) -> None:
    msg = report(1)
    msg.report.interval_s = interval_s
    assert "report.interval_s" in await refused(controller, msg)


@pytest.mark.parametrize(("engine", "where"), [
    ({"release": "0.18\n"}, "hello.engines[0].release: expected a version"),
    ({"version": "v" * 100_000}, "hello.engines[0].version: expected a version"),
    ({"version_match": 42}, "hello.engines[0].version_match: expected one of VERSION_MATCH_"),
    ({"version_source": "<script>"}, "hello.engines[0].version_source: expected one of"),
])
async def test_a_hello_with_hostile_engine_fields_is_refused_and_changes_nothing(
        controller: Controller, engine: dict[str, object], where: str) -> None:
    msg = hello("hostile-hello")
    fields = {"engine": "vllm", "version": "0.11.0", "release": "0.10.2",
              "version_match": agent_pb2.VERSION_MATCH_KNOWN, "version_source": "metadata",
              **engine}
    msg.hello.engines.add(**fields)  # type: ignore[arg-type]
    channel = aio.insecure_channel(f"127.0.0.1:{controller.port}")
    async with channel:
        call = agent_pb2_grpc.AgentServiceStub(channel).Connect()
        await call.write(msg)
        code, details = await status_of(call)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details.startswith(where) and len(details) < 400, details
    assert "hostile-hello" not in controller.fleet.hosts


async def test_duplicate_deployment_ids_are_refused(controller: Controller) -> None:
    msg = report(1)
    msg.report.deployments.add().CopyFrom(msg.report.deployments[0])
    assert "report.deployments[1].deployment_id: 'd1' again" in await refused(controller, msg)


async def test_a_second_stream_for_a_live_host_needs_its_session_token(
        controller: Controller) -> None:
    channel, first, welcome = await connect(controller, "h1")
    async with channel:
        await first.write(report(1))
        assert (await first.read()).ack.seq == 1
        assert len(welcome.session_token) >= 16
        # Someone else claims h1: refused; the real stream and its deployment stay.
        async with aio.insecure_channel(f"127.0.0.1:{controller.port}") as ch2:
            impostor = agent_pb2_grpc.AgentServiceStub(ch2).Connect()
            await impostor.write(hello("h1", token="guess"))
            code, details = await status_of(impostor)
        assert code == grpc.StatusCode.ALREADY_EXISTS and "session token" in details
        await first.write(report(2))
        assert (await first.read()).ack.seq == 2
        # The same agent reconnecting with its token replaces the stream, and the old
        # one ends with a status and a message.
        ch3, again, welcome2 = await connect(controller, "h1", token=welcome.session_token)
        async with ch3:
            code, details = await status_of(first)
            assert code == grpc.StatusCode.ABORTED and "reconnected" in details
            assert welcome2.session_token and welcome2.session_token != welcome.session_token
            await again.write(report(1))
            assert (await again.read()).ack.seq == 1
            again.cancel()


async def test_a_stream_ended_by_the_controller_carries_a_status(tmp_path: Path) -> None:
    ctl = Controller(ControllerConfig(listen="127.0.0.1:0", data_dir=tmp_path / "d",
                                      report_interval_s=0.2))
    await ctl.start()
    channel, call, _ = await connect(ctl, "h1")
    async with channel:
        stopping = asyncio.create_task(ctl.stop(1.0))
        code, details = await status_of(call)
        await stopping
    assert code == grpc.StatusCode.UNAVAILABLE
    assert "no longer leads" in details or "shutting down" in details


async def hosts(ctl: Controller) -> dict[str, control_pb2.Host]:
    async with aio.insecure_channel(f"127.0.0.1:{ctl.port}") as ch:
        resp = await control_pb2_grpc.ControlServiceStub(ch).ListHosts(control_pb2.ListHostsRequest())
    return {h.host_id: h for h in resp.hosts}
