"""A revoked host gets no more prompts: `gearshift hosts revoke` takes its deployments
out of the routing table at once, a live gateway stops sending it requests, and
neither its reports in flight nor a new hello put them back. A real controller and a
real gateway in this process; raw agent streams and small engines on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest
from aiohttp import web
from grpc import aio
from prometheus_client import CollectorRegistry

from gearshift.controller.server import Controller
from gearshift.gateway.server import Gateway, GatewayConfig
from gearshift.v1 import agent_pb2, agent_pb2_grpc, control_pb2_grpc, enrol_pb2

MODEL = "m"


class Engine:
    """An OpenAI-ish engine on 127.0.0.1:0 that counts the requests it serves."""

    def __init__(self) -> None:
        self.hits = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        return web.json_response({"choices": []})


class Agent:
    """A host's stream: a hello, then a report of one ready deployment every 0.1 s until
    the stream ends (its status is kept)."""

    def __init__(self, controller: Controller, host_id: str, engine: Engine) -> None:
        self.host_id, self.engine = host_id, engine
        self.channel = aio.insecure_channel(f"127.0.0.1:{controller.port}")
        self.call = agent_pb2_grpc.AgentServiceStub(self.channel).Connect()
        self.ended: asyncio.Future[grpc.StatusCode] = asyncio.get_running_loop().create_future()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await self.call.write(agent_pb2.AgentMessage(hello=agent_pb2.Hello(
            host_id=self.host_id, agent_version="test",
            protocol_version=agent_pb2.PROTOCOL_VERSION_1)))
        first = await self.call.read()
        assert first.WhichOneof("body") == "welcome", first
        self._tasks = [asyncio.create_task(self._report()), asyncio.create_task(self._read())]

    async def _report(self) -> None:
        seq = 0
        with contextlib.suppress(Exception):  # the stream ended: `_read` keeps why
            while True:
                seq += 1
                report = agent_pb2.Report(seq=seq, interval_s=0.2)
                report.deployments.add(
                    deployment_id=f"{self.host_id}-d", model=MODEL, engine="vllm",
                    phase=agent_pb2.DEPLOYMENT_PHASE_READY, endpoint=self.engine.url)
                await self.call.write(agent_pb2.AgentMessage(report=report))
                await asyncio.sleep(0.1)

    async def _read(self) -> None:
        with contextlib.suppress(grpc.RpcError):
            while await self.call.read() is not aio.EOF:
                pass
        self.ended.set_result(await self.call.code())

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.call.cancel()
        await self.channel.close()


@pytest.fixture
async def engines() -> AsyncIterator[dict[str, Engine]]:
    made = {"gpu-1": Engine(), "gpu-2": Engine()}
    for engine in made.values():
        await engine.start()
    try:
        yield made
    finally:
        for engine in made.values():
            await engine.stop()


async def _wait_for(what: str, check, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _hosts_routed(gateway: Gateway) -> set[str]:
    return {e.host_id for e in gateway.router.table.models.get(MODEL, ())}


async def _ask(http: aiohttp.ClientSession, gateway: Gateway, n: int) -> None:
    for _ in range(n):
        async with http.post(f"{gateway.url}/v1/chat/completions",
                             json={"model": MODEL, "messages": []}) as resp:
            assert resp.status == 200, await resp.text()


async def test_a_revoked_hosts_deployments_get_no_more_requests(
        controller: Controller, engines: dict[str, Engine]) -> None:
    gateway = Gateway(GatewayConfig(listen_port=0, controller=f"127.0.0.1:{controller.port}",
                                    gateway_id="revocation-test"), registry=CollectorRegistry())
    agents = [Agent(controller, host, engine) for host, engine in engines.items()]
    await gateway.start()
    try:
        for agent in agents:
            await agent.start()
        await _wait_for("both hosts routed by the gateway",
                        lambda: _hosts_routed(gateway) == {"gpu-1", "gpu-2"})
        async with aiohttp.ClientSession() as http:
            await _ask(http, gateway, 40)
            assert engines["gpu-1"].hits > 0 and engines["gpu-2"].hits > 0

            async with aio.insecure_channel(f"127.0.0.1:{controller.port}") as channel:
                await control_pb2_grpc.ControlServiceStub(channel).RevokeHost(
                    enrol_pb2.HostActionRequest(host_id="gpu-1", reason="stolen disk"))
            # Gone from the controller's table at once, from the gateway's within a push.
            assert {e.host_id for m in controller.fleet.routing_table().models
                    for e in m.endpoints} == {"gpu-2"}
            await _wait_for("the gateway's table without gpu-1",
                            lambda: _hosts_routed(gateway) == {"gpu-2"}, timeout_s=2.0)
            assert await asyncio.wait_for(agents[0].ended, 5) == grpc.StatusCode.PERMISSION_DENIED

            # A new hello from the revoked host is refused; nothing brings its route back.
            again = Agent(controller, "gpu-1", engines["gpu-1"])
            try:
                with pytest.raises(aio.AioRpcError) as refused:  # no welcome
                    await again.start()
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "is revoked" in (refused.value.details() or "")
            finally:
                await again.stop()
            hits = engines["gpu-1"].hits
            await _ask(http, gateway, 40)
            assert engines["gpu-1"].hits == hits
            assert _hosts_routed(gateway) == {"gpu-2"} and "gpu-1" not in controller.fleet.hosts
            assert agents[1].ended.done() is False  # the other host is untouched
    finally:
        for agent in agents:
            await agent.stop()
        await gateway.stop()
