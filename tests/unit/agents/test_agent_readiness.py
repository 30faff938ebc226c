"""The agent's /readyz: not ready until a controller has welcomed it once; from then on
fail static, ready while the controller is away."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from grpc import aio

from gearshift.agents.config import AgentConfig
from gearshift.agents.daemon import Agent
from gearshift.v1 import agent_pb2, agent_pb2_grpc


class Welcomes(agent_pb2_grpc.AgentServiceServicer):
    """Welcomes each hello and keeps the stream open, acknowledging nothing."""

    async def Connect(self, request_iterator: AsyncIterator[agent_pb2.AgentMessage],
                      context: aio.ServicerContext) -> AsyncIterator[agent_pb2.ControllerMessage]:
        async for msg in request_iterator:
            if msg.WhichOneof("body") == "hello":
                yield agent_pb2.ControllerMessage(welcome=agent_pb2.Welcome(
                    controller_id="c1", controller_epoch=1, report_interval_s=0.1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_not_ready_before_the_first_welcome_then_fail_static(tmp_path: Path) -> None:
    port = _free_port()  # nothing listens there yet: every connection is refused
    agent = Agent(AgentConfig.model_validate({
        "host_id": "h1", "controller": f"127.0.0.1:{port}", "workdir": str(tmp_path / "agent"),
        "report_interval_s": 0.1, "gpus": {"source": "none"}}), backoff_max_s=0.05)
    task = asyncio.create_task(agent.run())
    server: aio.Server | None = None
    try:
        await _until(lambda: agent.started, "the agent to start its engines")
        await asyncio.sleep(0.3)  # several refused connections
        ready, why = agent.readiness()
        assert not ready, why
        assert "controller" in why and f"127.0.0.1:{port}" in why

        server = aio.server()
        agent_pb2_grpc.add_AgentServiceServicer_to_server(Welcomes(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await _until(lambda: agent.readiness()[0], "ready once welcomed")
        assert agent.readiness() == (True, "connected to c1")

        await server.stop(0)  # the controller goes away: fail static, still ready
        server = None
        await _until(lambda: not agent.connected.is_set(), "the agent to notice")
        assert agent.readiness() == (True, "fail static: no controller stream; "
                                           "0 engine(s) ready")
    finally:
        agent.stop()
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 10)
        finally:
            if server is not None:
                await server.stop(0)
