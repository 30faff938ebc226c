"""gRPC's floor under the ingest bench: the agent stream read and acked, nothing applied.

    python bench/ingest.py --floor --agents 10000 --deployments-per-agent 8 --duration-s 40

`bench/ingest.py --floor` starts this in place of the controller. It serves
`AgentService.Connect` as the controller does on the wire and on the event loop: the
controller's server options (`controller.api.grpc_server.SERVER_OPTIONS`) and event loop
(`common.event_loop`, uvloop), each message read with `context.read()` and parsed by
the same generated code, a Welcome for the Hello and an Ack for each Report, written
with `context.write()` one at a time. It validates nothing and keeps nothing: no
fleet, no rollups, no store, no metrics. Its CPU is what gRPC's asyncio server costs
a fleet of that size on this machine before the controller does any work of its own;
the controller's CPU in the same bench, less this, is the controller's.

Usage: python bench/grpc_floor.py READY_FILE INTERVAL_S
(writes "PORT PID" to READY_FILE once serving; the Welcome gives INTERVAL_S)
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from grpc import aio

from gearshift.common.event_loop import run_event_loop
from gearshift.controller.api.grpc_server import SERVER_OPTIONS
from gearshift.v1 import agent_pb2, agent_pb2_grpc


class ReadAndAck(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s

    async def Connect(self, request_iterator: AsyncIterator[agent_pb2.AgentMessage],
                      context: aio.ServicerContext) -> None:
        if await context.read() is aio.EOF:
            return
        await context.write(agent_pb2.ControllerMessage(welcome=agent_pb2.Welcome(
            report_interval_s=self.interval_s, controller_epoch=1, controller_id="grpc-floor",
            session_token="floor")))
        while (msg := await context.read()) is not aio.EOF:
            if msg.WhichOneof("body") != "report":
                continue
            ack = agent_pb2.ControllerMessage()
            ack.ack.seq = msg.report.seq
            del msg  # not held while the next one is awaited, as the controller does
            await context.write(ack)
            del ack


async def serve(ready_file: Path, interval_s: float) -> None:
    server = aio.server(options=SERVER_OPTIONS)
    agent_pb2_grpc.add_AgentServiceServicer_to_server(ReadAndAck(interval_s), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    tmp = ready_file.with_suffix(".tmp")
    tmp.write_text(f"{port} {os.getpid()}")
    tmp.replace(ready_file)  # whole or absent: the bench polls for it
    await server.wait_for_termination()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    run_event_loop(serve(Path(sys.argv[1]), float(sys.argv[2])))
