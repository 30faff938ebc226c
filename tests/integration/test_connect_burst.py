"""A fleet connecting at once: every agent stream gets its Welcome.

The controller runs in this process; a second process opens the agent streams (as
many hosts reconnecting after a controller restart would) while the controller's
event loop is held busy, so they all wait in gRPC core's queue of streams the
Python server has not taken yet. None may be dropped from that queue.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from gearshift.controller.server import Controller

STREAMS = 2_000  # twice gRPC core's default soft limit on queued streams
CHANNELS = 20
BUSY_S = 3.0  # the controller's loop blocked while the client opens its streams

CLIENT = r"""
import asyncio, json, sys
import grpc
from grpc import aio
from gearshift.v1 import agent_pb2, agent_pb2_grpc

addr, streams, channels = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

async def agent(stub, i, out):
    call = stub.Connect()
    msg = agent_pb2.AgentMessage(hello=agent_pb2.Hello(
        host_id=f"burst-{i}", agent_version="test",
        protocol_version=agent_pb2.PROTOCOL_VERSION_1))
    try:
        await call.write(msg)
        first = await call.read()
        kind = "welcome" if first is not aio.EOF and first.WhichOneof("body") == "welcome" \
            else "other"
    except grpc.aio.AioRpcError as exc:
        kind = exc.code().name
    out[kind] = out.get(kind, 0) + 1
    return call

async def main():
    chans = [aio.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1)])
             for _ in range(channels)]
    for ch in chans:
        await ch.channel_ready()
    print("ready", flush=True)
    out = {}
    stubs = [agent_pb2_grpc.AgentServiceStub(ch) for ch in chans]
    calls = await asyncio.gather(*(agent(stubs[i % channels], i, out) for i in range(streams)))
    print(json.dumps(out), flush=True)
    for c in calls:
        c.cancel()
    for ch in chans:
        await ch.close()

asyncio.run(main())
"""


@pytest.fixture
def report_interval_s() -> float:
    return 10.0


async def test_streams_arriving_faster_than_the_loop_takes_them_all_get_a_welcome(
        controller: Controller) -> None:
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, f"127.0.0.1:{controller.port}", str(STREAMS),
         str(CHANNELS)], stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "ready"
        # Hold the controller's loop: the streams opened meanwhile queue in gRPC core.
        time.sleep(BUSY_S)
        line = await asyncio.to_thread(client.stdout.readline)
        assert await asyncio.to_thread(client.wait, 60) == 0
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    assert json.loads(line) == {"welcome": STREAMS}
