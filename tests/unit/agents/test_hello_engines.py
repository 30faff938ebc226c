"""The Hello lists the engines a host has: those its config names (or a deployment
uses), and those whose version was found; not every engine of the catalog."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from grpc import aio

from gearshift.agents.config import AgentConfig
from gearshift.agents.daemon import Agent
from gearshift.v1 import agent_pb2, agent_pb2_grpc


class RecordsHellos(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self) -> None:
        self.hellos: list[agent_pb2.Hello] = []

    async def Connect(self, request_iterator: AsyncIterator[agent_pb2.AgentMessage],
                      context: aio.ServicerContext) -> AsyncIterator[agent_pb2.ControllerMessage]:
        async for msg in request_iterator:
            if msg.WhichOneof("body") == "hello":
                self.hellos.append(msg.hello)
                yield agent_pb2.ControllerMessage(welcome=agent_pb2.Welcome(
                    controller_id="c1", controller_epoch=1, report_interval_s=0.1))


async def test_an_engine_the_host_lacks_is_not_in_the_hello(tmp_path: Path) -> None:
    servicer = RecordsHellos()
    server = aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    # vLLM only: no `engines.sglang` / `engines.tensorrt-llm` entry, and neither is
    # installed where this runs (their version probes find nothing; the agent connects
    # after they end, since its deployment waits for them).
    agent = Agent(AgentConfig.model_validate({
        "host_id": "h1", "controller": f"127.0.0.1:{port}", "workdir": str(tmp_path / "agent"),
        "report_interval_s": 0.1, "gpus": {"source": "emulated", "emulated": {"count": 1}},
        "drain_on_exit": True,
        "engines": {"vllm": {"executable": [sys.executable, "-m", "gearshift.agents.emulator",
                                            "--flavor", "vllm", "--engine-version", "0.11.0",
                                            "--"],
                             "version": "0.11.0", "env": {"GEARSHIFT_EMULATOR_LOAD_S": "0.1"}}},
        "deployments": [{"deployment_id": "d1", "model": "m", "engine": "vllm",
                         "gpu_indices": [0]}]}))
    task = asyncio.create_task(agent.run())
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while not servicer.hellos and not task.done() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        assert servicer.hellos, task.exception() if task.done() else "no hello"
        engines = {e.engine: e for e in servicer.hellos[0].engines}
        assert set(engines) == {"vllm"}, [f"{e.engine} {e.version!r}" for e in engines.values()]
        assert engines["vllm"].version == "0.11.0"
        assert engines["vllm"].version_match == agent_pb2.VERSION_MATCH_KNOWN
    finally:
        task.cancel()  # as SIGTERM does (run_agent): the open stream ends at once
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 20)
        finally:
            await server.stop(0)
