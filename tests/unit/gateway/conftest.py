"""Real loopback parts for the gateway tests: small aiohttp upstreams, hand-scripted raw
engines, a gRPC controller that only implements WatchRoutes/ReportGateway, and the gateway
itself on port 0 (with its metrics listener on another port 0)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from gearshift.gateway.routes import table_from_mapping
from gearshift.gateway.server import Gateway, GatewayConfig
from gearshift.v1 import control_pb2, control_pb2_grpc


class Upstream:
    """An OpenAI-ish engine on 127.0.0.1:0.

    mode: "ok" (JSON, or SSE when the body asks `stream`), "503" (always 503),
    "truncate" (one SSE chunk, then the connection is cut).
    A streaming reply sends its first chunk, then waits for `release` before the rest.
    """

    def __init__(self, name: str, mode: str = "ok") -> None:
        self.name = name
        self.mode = mode
        self.hits = 0
        self.release = asyncio.Event()
        self.finished_streams = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        body = await request.json()
        if self.mode == "503":
            return web.json_response({"error": {"message": f"{self.name} overloaded"}},
                                     status=503)
        if self.mode == "truncate" or body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(f"data: {json.dumps({'served_by': self.name, 'i': 0})}\n\n".encode())
            if self.mode == "truncate":
                assert request.transport is not None
                request.transport.close()  # cut mid-stream, no terminating chunk
                return resp
            await self.release.wait()
            for i in range(1, 4):
                await resp.write(f"data: {json.dumps({'i': i})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            self.finished_streams += 1
            return resp
        return web.json_response({"served_by": self.name, "model": body.get("model"),
                                  "path": request.path, "auth": request.headers.get("Authorization")})


class FakeController(control_pb2_grpc.ControlServiceServicer):
    """Only WatchRoutes (tables put on `tables` are streamed) and ReportGateway (kept)."""

    def __init__(self) -> None:
        self.tables: asyncio.Queue[control_pb2.RoutingTable | None] = asyncio.Queue()
        self.reports: list[control_pb2.GatewayReport] = []
        self.watchers = 0
        self.server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self, port: int = 0) -> str:
        self.server = grpc.aio.server()
        control_pb2_grpc.add_ControlServiceServicer_to_server(self, self.server)
        bound = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        self.address = f"127.0.0.1:{bound}"
        return self.address

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None

    async def WatchRoutes(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.watchers += 1
        while True:
            table = await self.tables.get()
            if table is None:  # end this stream; the gateway should reconnect
                return
            yield table

    async def ReportGateway(self, request: Any, context: Any) -> Any:
        self.reports.append(request)
        return control_pb2.GatewayReportAck()


Script = Callable[[int, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Engine:
    """A loopback server whose answers are written by `script(connection_number, r, w)`."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests = 0
        self.closed = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> Engine:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        self.requests += 1
        return head + await reader.readexactly(length)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.script(self.connections, reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.closed += 1

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()


@pytest.fixture
async def engine() -> AsyncIterator[Callable[[Script], Awaitable[Engine]]]:
    started: list[Engine] = []

    async def make(script: Script) -> Engine:
        started.append(await Engine(script).start())
        return started[-1]

    yield make
    for e in started:
        await e.stop()


@pytest.fixture
async def upstreams() -> AsyncIterator[Callable[..., Awaitable[Upstream]]]:
    started: list[Upstream] = []

    async def make(name: str, mode: str = "ok") -> Upstream:
        up = Upstream(name, mode)
        await up.start()
        started.append(up)
        return up

    yield make
    for up in started:
        up.release.set()
        await up.stop()


@pytest.fixture
async def controller() -> AsyncIterator[FakeController]:
    c = FakeController()
    await c.start()
    yield c
    await c.stop()


@pytest.fixture
async def gateways() -> AsyncIterator[Callable[..., Awaitable[Gateway]]]:
    started: list[Gateway] = []

    async def make(routes: dict[str, Any] | None = None, **overrides: Any) -> Gateway:
        rng = overrides.pop("rng", None)
        overrides.setdefault("metrics_listen", ("127.0.0.1", 0))
        config = GatewayConfig(listen_host="127.0.0.1", listen_port=0, **overrides)
        table = None if routes is None else table_from_mapping(routes, where="test routes")
        gw = Gateway(config, registry=CollectorRegistry(), rng=rng, table=table)
        await gw.start()
        started.append(gw)
        return gw

    yield make
    for gw in started:
        await gw.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
