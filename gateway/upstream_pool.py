"""Kept-alive connections from the gateway to the engines, pooled per endpoint.

`UpstreamPool.request(key, data)` sends one serialized request on an idle pooled
connection (or a new one) and returns that `UpstreamConnection` once the response
head is in; after the body is read, `release` gives it back (kept when the
response ended cleanly and both sides allow keep-alive, closed otherwise).

An engine may close an idle kept-alive connection just as a request goes out on
it (its keep-alive timeout racing the request); when the response then ends
before its first byte, the request is sent once more on a new connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque

from gearshift.gateway.upstream import (
    UpstreamConnectError,
    UpstreamConnection,
    UpstreamError,
    UpstreamKey,
    UpstreamTimeout,
)


class UpstreamPool:
    """Kept-alive connections to every engine, at most `limit` open at once."""

    def __init__(self, limit: int, connect_timeout_s: float, read_timeout_s: float,
                 idle_timeout_s: float, body_timeout_s: float | None = None) -> None:
        """`read_timeout_s` bounds the wait for a response head, `body_timeout_s` (default:
        the same) a gap in its body."""
        self.limit = limit
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.body_timeout_s = read_timeout_s if body_timeout_s is None else body_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._idle: dict[UpstreamKey, list[UpstreamConnection]] = {}
        self._open: set[UpstreamConnection] = set()
        self._connecting = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._ssl: ssl.SSLContext | None = None

    async def request(self, key: UpstreamKey, data: bytes, body: bytes = b"",
                      ) -> UpstreamConnection:
        """Send `data` (then `body`) to the engine at `key`; the connection, once the response
        head is in."""
        for fresh in (False, True):
            conn = await self._acquire(key, fresh)
            conn.send(data, body)
            try:
                await conn.wait_head()
            except UpstreamError as err:
                conn.close()
                if not conn.reused or conn.got_data or isinstance(err, UpstreamTimeout):
                    raise
                continue  # a kept-alive connection the engine had closed: nothing reached it
            except BaseException:
                conn.close()
                raise
            return conn
        raise AssertionError("unreachable: a new connection is never `reused`")

    def release(self, conn: UpstreamConnection) -> None:
        """Give a connection back after its exchange: pooled if reusable, else closed."""
        if conn not in self._open:
            return
        if not conn.reusable:
            conn.close()
            return
        conn.make_idle()
        self._idle.setdefault(conn.key, []).append(conn)
        self._wake_one()

    def discard(self, conn: UpstreamConnection) -> None:
        """Forget a connection that is closing (idempotent)."""
        if conn in self._open:
            self._open.discard(conn)
            idle = self._idle.get(conn.key)
            if idle and conn in idle:
                idle.remove(conn)
            self._wake_one()

    def close(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._idle.clear()

    async def _acquire(self, key: UpstreamKey, fresh: bool) -> UpstreamConnection:
        """An idle connection to `key` (unless `fresh`), or a new one when the limit allows."""
        while True:
            idle = self._idle.get(key)
            if idle and not fresh:
                return idle.pop()
            if len(self._open) + self._connecting < self.limit:
                return await self._connect(key)
            victim = next((c for conns in self._idle.values() for c in conns), None)
            if victim is not None:  # make room by closing another endpoint's idle connection
                victim.close()
                continue
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if not waiter.done():
                    waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)

    async def _connect(self, key: UpstreamKey) -> UpstreamConnection:
        host, port, tls = key
        if not host or not port:
            raise UpstreamConnectError("the endpoint's address is not a valid http(s)://HOST:PORT")
        loop = asyncio.get_running_loop()
        ssl_context = None
        if tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ssl_context = self._ssl
        self._connecting += 1
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: UpstreamConnection(self, key), host, port,
                                       ssl=ssl_context),
                self.connect_timeout_s)
        except TimeoutError:
            raise UpstreamTimeout(f"connecting to {host}:{port} took more than "
                                  f"{self.connect_timeout_s:g} s") from None
        except OSError as err:
            raise UpstreamConnectError(f"cannot connect to {host}:{port}: "
                                       f"{err.strerror or err}") from None
        finally:
            self._connecting -= 1
            self._wake_one()
        self._open.add(conn)
        return conn

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

