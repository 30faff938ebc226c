"""The gateway's HTTP/1.1 listener: accepts client connections and runs the handler.

Each connection (`gearshift.gateway.connection.ClientConnection`) reads one request
at a time, within the limits of `gearshift.gateway.limits.ClientLimits`, and hands
it to the handler as a `gearshift.gateway.request.Request`. `stop()` stops
accepting, closes idle connections and gives requests in flight a grace period
before cutting them.

Why not aiohttp's server: see `gearshift.gateway.http11`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from gearshift.gateway.connection import ClientConnection
from gearshift.gateway.limits import BodyBudget, ClientLimits
from gearshift.gateway.request import Request

Handler = Callable[[Request], Awaitable[None]]


class HttpListener:
    """Accepts client connections on one address and runs `handler` for each request."""

    def __init__(self, handler: Handler, limits: ClientLimits | None = None,
                 on_refusal: Callable[[str], None] | None = None) -> None:
        self.handler = handler
        self.limits = limits or ClientLimits()
        self.budget = BodyBudget(self.limits.body_budget_bytes)
        self.connections: set[ClientConnection] = set()
        self.stopping = False
        self._on_refusal = on_refusal
        self._server: asyncio.Server | None = None
        self._all_closed: asyncio.Event | None = None

    async def start(self, host: str, port: int, backlog: int = 1024) -> int:
        """Listen on host:port (port 0: any free port); returns the port. Raises OSError."""
        self._server = await asyncio.get_running_loop().create_server(
            lambda: ClientConnection(self), host, port, backlog=backlog, reuse_address=True)
        return int(self._server.sockets[0].getsockname()[1])

    def refused(self, reason: str) -> None:
        if self._on_refusal is not None:
            self._on_refusal(reason)

    def forget(self, conn: ClientConnection) -> None:
        self.connections.discard(conn)
        if not self.connections and self._all_closed is not None:
            self._all_closed.set()

    async def stop(self, grace_s: float) -> None:
        """Stop accepting; let requests in flight finish for up to `grace_s`, then cut them."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        self._all_closed = asyncio.Event()
        for conn in list(self.connections):
            if not conn.busy:
                conn.close_now()
        if self.connections:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_closed.wait(), grace_s)
        tasks = [t for t in (conn.cancel() for conn in list(self.connections)) if t is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
