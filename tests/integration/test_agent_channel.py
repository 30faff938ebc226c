"""The agent's channel to the controller (`agents.daemon.CHANNEL_OPTIONS`) on the wire: gRPC's
client, as the agent opens it, sends no HTTP/2 PING for the messages it reads.

With gRPC's bandwidth-delay probe on (its default) the client pings for the first DATA
frame it reads once the probe's delay has passed (100 ms at first, growing towards 10 s
while its estimate holds: gRPC core's src/core/lib/transport/bdp_estimator.cc), so on an
agent's stream, one report every 10 s, for about every ack. The server here is a few
lines of HTTP/2 that answer each message with one and count the client's PINGs, which
gRPC's own server would answer without showing them.
"""

from __future__ import annotations

import asyncio
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from grpc import aio
from hpack import Encoder

from gearshift.agents.daemon import CHANNEL_OPTIONS

# The ingest bench's HTTP/2 frames (bench/ is not a package).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from agent_wire import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PING,
    PREFACE,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
)

MESSAGES = 5


class EchoServer(asyncio.Protocol):
    """One connection: answers each gRPC message of a stream with the same bytes, and
    ends the stream (status OK) when the client ends its side."""

    def __init__(self) -> None:
        self.pings = 0
        self.encoder = Encoder()
        self.buf = bytearray()
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.write(frame(SETTINGS, 0, 0, b""))

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.buf.startswith(PREFACE):
            del self.buf[:len(PREFACE)]
        while len(self.buf) >= 9:
            length = int.from_bytes(self.buf[:3], "big")
            if len(self.buf) < 9 + length:
                return
            kind, flags = self.buf[3], self.buf[4]
            sid = int.from_bytes(self.buf[5:9], "big") & 0x7FFFFFFF
            payload = bytes(self.buf[9:9 + length])
            del self.buf[:9 + length]
            self.on_frame(kind, flags, sid, payload)

    def on_frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        write = self.transport.write
        if kind == SETTINGS and not flags & ACK:
            write(frame(SETTINGS, ACK, 0, b""))
        elif kind == PING and not flags & ACK:
            self.pings += 1
            write(frame(PING, ACK, 0, payload))
        elif kind == HEADERS:  # the call opens: answer with the response headers
            write(frame(HEADERS, END_HEADERS, sid, self.encoder.encode(
                [(":status", "200"), ("content-type", "application/grpc")])))
        elif kind == DATA:
            if payload:  # the window back, then the message itself
                increment = struct.pack(">I", len(payload))
                write(frame(WINDOW_UPDATE, 0, 0, increment)
                      + frame(WINDOW_UPDATE, 0, sid, increment) + frame(DATA, 0, sid, payload))
            if flags & END_STREAM:
                write(frame(HEADERS, END_HEADERS | END_STREAM, sid,
                            self.encoder.encode([("grpc-status", "0")])))


async def pings_for_messages(options: list[tuple[str, int]]) -> int:
    """Run MESSAGES request-and-answer rounds on one stream of a channel opened with
    `options`; returns the PINGs the client sent."""
    loop = asyncio.get_running_loop()
    servers: list[EchoServer] = []

    def accept() -> EchoServer:
        servers.append(EchoServer())
        return servers[-1]

    server = await loop.create_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            call = channel.stream_stream("/test.Echo/Echo")()
            for i in range(MESSAGES):
                await call.write(b"report %d" % i)
                assert await asyncio.wait_for(call.read(), 10) == b"report %d" % i
            await call.done_writing()
            assert await asyncio.wait_for(call.read(), 10) is aio.EOF
    finally:
        server.close()
        await server.wait_closed()
    return sum(s.pings for s in servers)


@pytest.mark.parametrize("bdp_probe", [1, None], ids=["probe-on", "agent-options"])
async def test_the_agents_channel_sends_no_ping_for_the_acks_it_reads(bdp_probe: int | None) -> None:
    if bdp_probe is None:
        assert await pings_for_messages(CHANNEL_OPTIONS) == 0
    else:  # gRPC's default, which the agent's options turn off: the first answer drew one
        assert await pings_for_messages([("grpc.http2.bdp_probe", bdp_probe)]) >= 1
