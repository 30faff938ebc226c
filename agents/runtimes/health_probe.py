"""One engine's health probe: `GET path` on a kept-alive HTTP/1.1 connection, status only.

The supervisor probes each engine every `health_interval_s` (1 s): beside 8 engines
that is 8 requests a second, the larger part of an idle agent's CPU when made with
aiohttp's client (~300 us of CPU each: request and response objects, tracing
hooks, a timeout context). Here one connection per engine is kept open, the
request is the same bytes every time, and the answer is read as far as its
status line, its headers and the body they announce (~60 us).

What the supervisor reads of an answer is what it read from aiohttp: the status;
`None` when the connection is refused (or cannot be made at all: the engine has
not bound its port); `ProbeFailed` when the connection breaks, the answer is not
HTTP, or no complete answer comes within the timeout (connect included).

A connection is reused only after an answer framed by `Content-Length`, without
`Connection: close`; any other answer (chunked, or read to the close) gives its
status and the connection is closed. A request on a reused connection that the
engine had closed meanwhile (its keep-alive timeout) is sent again once on a new
connection, as browsers do with an idempotent request.
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 16 * 1024  # status line and headers; a health answer has a few
MAX_BODY_BYTES = 64 * 1024  # a health body is "" or a short JSON
HEAD_END = b"\r\n\r\n"


class ProbeFailed(Exception):
    """The engine accepted the connection but gave no usable answer in time."""


class _Answer(asyncio.Protocol):
    """One connection; reads one answer at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.bytes_read = 0  # of the answer being read
        self._buffer = bytearray()
        self._waiter: asyncio.Future[int] | None = None
        self._status = 0
        self._body_left = -1  # bytes of body still to come; -1 while the head is read

    def expect(self, waiter: asyncio.Future[int]) -> None:
        self._waiter = waiter
        self._status = 0
        self._body_left = -1
        self.bytes_read = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(f"connection closed{f': {exc}' if exc else ''}")

    def eof_received(self) -> bool:
        self.closed = True
        self._fail("connection closed by the engine")
        return False  # close the transport

    def data_received(self, data: bytes) -> None:
        if self._waiter is None or self._waiter.done():
            self._close()  # bytes nobody asked for: the connection cannot be trusted
            return
        self.bytes_read += len(data)
        if self._body_left >= 0:
            self._body_left -= len(data)
            self._done_if_complete()
            return
        self._buffer += data
        end = self._buffer.find(HEAD_END)
        if end < 0:
            if len(self._buffer) > MAX_HEAD_BYTES:
                self._fail(f"answer head over {MAX_HEAD_BYTES} bytes", close=True)
            return
        head = bytes(self._buffer[:end])
        body = len(self._buffer) - end - len(HEAD_END)
        self._buffer.clear()
        self._read_head(head, body)

    def _read_head(self, head: bytes, body_received: int) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            self._fail(f"not an HTTP answer: {lines[0][:80]!r}", close=True)
            return
        self._status = int(parts[1])
        length: int | None = None
        keep = parts[0] == b"HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                try:
                    length = int(value.strip())
                except ValueError:
                    length = None
                    keep = False
            elif name == b"transfer-encoding" or (
                    name == b"connection" and value.strip().lower() == b"close"):
                keep = False
        if length is None or not keep or length > MAX_BODY_BYTES:
            self._resolve()  # the status is known; the rest of the body is not read
            self._close()
            return
        self._body_left = length - body_received
        self._done_if_complete()

    def _done_if_complete(self) -> None:
        if self._body_left == 0:
            self._resolve()
        elif self._body_left < 0:  # more bytes than announced
            self._resolve()
            self._close()

    def _resolve(self) -> None:
        waiter = self._waiter
        self._waiter = None
        if waiter is not None and not waiter.done():
            waiter.set_result(self._status)

    def _fail(self, why: str, *, close: bool = False) -> None:
        waiter = self._waiter
        self._waiter = None
        if waiter is not None and not waiter.done():
            waiter.set_exception(ProbeFailed(why))
        if close:
            self._close()

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class HealthProbe:
    """GETs one URL on a kept-alive connection; one probe at a time."""

    def __init__(self, url: str, timeout_s: float) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"health URL must be http://HOST:PORT/PATH, got {url!r}")
        if timeout_s <= 0:
            raise ValueError(f"health probe timeout_s {timeout_s} must be > 0")
        self.url = url
        self._host = parts.hostname
        self._port = parts.port or 80
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        host_header = f"[{self._host}]" if ":" in self._host else self._host
        self._request = (f"GET {path} HTTP/1.1\r\nHost: {host_header}:{self._port}\r\n"
                         "Accept: */*\r\nUser-Agent: gearshift-agent\r\n\r\n").encode("ascii")
        self._timeout_s = timeout_s
        self._conn: _Answer | None = None

    async def status(self) -> int | None:
        """The HTTP status of one GET; None when the connection cannot be made (refused).
        Raises `ProbeFailed`, or `TimeoutError` when no complete answer comes within the
        timeout (connect included)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        try:
            conn = self._conn
            if conn is not None and not conn.closed:
                try:
                    return await self._ask(conn, loop, deadline)
                except ProbeFailed:
                    if conn.bytes_read:
                        raise
                # The engine closed the kept connection before answering (its keep-alive
                # timeout): once more on a new one.
            self.close()
            conn = await self._connect(loop, deadline)
            if conn is None:
                return None
            return await self._ask(conn, loop, deadline)
        except BaseException:
            self.close()  # an answer may still come: this connection cannot be reused
            raise

    async def _connect(self, loop: asyncio.AbstractEventLoop, deadline: float
                       ) -> _Answer | None:
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Answer, self._host, self._port),
                max(0.0, deadline - loop.time()))
        except OSError:
            return None  # refused (or no route): the engine is not listening
        self._conn = conn
        return conn

    async def _ask(self, conn: _Answer, loop: asyncio.AbstractEventLoop,
                   deadline: float) -> int:
        assert conn.transport is not None
        waiter: asyncio.Future[int] = loop.create_future()
        timer = loop.call_at(deadline, _time_out, waiter)
        try:
            conn.expect(waiter)
            conn.transport.write(self._request)
            status = await waiter
        finally:
            timer.cancel()
        if conn.closed:
            self._conn = None
        return status

    def close(self) -> None:
        """Close the kept connection (a later probe opens a new one)."""
        conn, self._conn = self._conn, None
        if conn is not None and conn.transport is not None:
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                conn.transport.close()


def _time_out(waiter: asyncio.Future[int]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())
