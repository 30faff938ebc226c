"""The agent outlives a controller stream that ends while a report is being built:
the write that follows finds the call finished, and the agent reconnects instead of
leaving (which would stop its metrics listener and detach its engines)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from grpc import aio

from gearshift.agents.config import AgentConfig
from gearshift.agents.daemon import Agent
from gearshift.v1 import agent_pb2, agent_pb2_grpc


class ShortStreams(agent_pb2_grpc.AgentServiceServicer):
    """Welcomes each hello, then ends the stream with OK at once."""

    def __init__(self) -> None:
        self.hellos = 0

    async def Connect(self, request_iterator: AsyncIterator[agent_pb2.AgentMessage],
                      context: aio.ServicerContext) -> AsyncIterator[agent_pb2.ControllerMessage]:
        async for msg in request_iterator:
            if msg.WhichOneof("body") == "hello":
                self.hellos += 1
                yield agent_pb2.ControllerMessage(welcome=agent_pb2.Welcome(
                    controller_id="short", controller_epoch=1, report_interval_s=0.05))
                return


async def test_a_stream_ending_during_a_report_build_is_reconnected(tmp_path: Path) -> None:
    servicer = ShortStreams()
    server = aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    agent = Agent(AgentConfig.model_validate({
        "host_id": "h1", "controller": f"127.0.0.1:{port}", "workdir": str(tmp_path / "agent"),
        "report_interval_s": 0.05, "gpus": {"source": "none"}, "deployments": []}),
        backoff_max_s=0.05)
    build = agent.build_report

    async def slow_build() -> agent_pb2.Report:
        await asyncio.sleep(0.3)  # the controller's OK arrives meanwhile
        return await build()

    agent.build_report = slow_build  # type: ignore[method-assign]
    task = asyncio.create_task(agent.run())
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        # The servicer counts a hello before the agent has read its welcome: wait
        # for both sides to have seen the third stream.
        while ((servicer.hellos < 3 or agent.connects < 3) and not task.done()
               and loop.time() < deadline):
            await asyncio.sleep(0.05)
        assert not task.done(), task.exception() if task.done() else None
        assert servicer.hellos >= 3 and agent.connects >= 3
    finally:
        agent.stop()
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 10)
        finally:
            await server.stop(0)
