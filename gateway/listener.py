"""The gateway's HTTP/1.1 listener: keep-alive client connections on plain asyncio protocols.

Each connection handles one request at a time (pipelined requests wait in its
buffer) and hands it to the handler as a `Request`, which answers whole
(`respond`) or as a chunked stream (`start_stream`, `write`, `end_stream`, or
`abort` to cut it so the client sees a truncated body). `write` waits while the
client's socket buffer is full, so a slow reader slows its own stream instead of
filling the gateway's memory. Framing errors get an OpenAI-shaped JSON error and
the connection is closed. `stop()` stops accepting, closes idle connections and
gives requests in flight a grace period before cutting them.

Why not aiohttp's server: see `gearshift.gateway.http11`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable

from gearshift.gateway.http11 import (
    LAST_CHUNK,
    MAX_HEAD_BYTES,
    ChunkedDecoder,
    HttpError,
    RequestHead,
    date_header,
    encode_chunk,
    parse_request_head,
    status_line,
)

log = logging.getLogger(__name__)

CLIENT_MAX_BODY_BYTES = 64 * 1024 * 1024
CLIENT_IDLE_TIMEOUT_S = 75.0  # a kept-alive client connection with no request is closed after this
MAX_PIPELINED_BYTES = 1024 * 1024  # stop reading from a client that sends this far ahead
JSON_HEADERS = b"Content-Type: application/json\r\n"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def openai_error_body(message: str, err_type: str, code: str, param: str | None = None) -> bytes:
    """An error body in the OpenAI shape: {"error": {message, type, param, code}}."""
    return json.dumps({"error": {"message": message, "type": err_type, "param": param,
                                 "code": code}}).encode()


Handler = Callable[["Request"], Awaitable[None]]

_NOTHING_SENT, _STREAMING, _DONE = range(3)


class Request:
    """One request on a client connection, and the means to answer it."""

    __slots__ = ("_chunked", "_conn", "_state", "body", "head")

    def __init__(self, conn: _Connection, head: RequestHead, body: bytes) -> None:
        self.head = head
        self.body = body
        self._conn = conn
        self._state = _NOTHING_SENT
        self._chunked = head.http11

    @property
    def method(self) -> bytes:
        return self.head.method

    @property
    def path(self) -> str:
        return self.head.path

    @property
    def answered(self) -> bool:
        """True once a response head went out (the request can no longer be retried elsewhere)."""
        return self._state != _NOTHING_SENT

    def _end_head(self) -> bytes:
        keep = self.head.keep_alive and self._conn.keeps_alive
        if not keep:
            return b"Connection: close\r\n\r\n"
        return b"\r\n" if self.head.http11 else b"Connection: keep-alive\r\n\r\n"

    def respond(self, status: int, body: bytes, headers: bytes = JSON_HEADERS) -> None:
        """Send a whole response; `headers` is a block of `Name: value\\r\\n` lines."""
        if self._state != _NOTHING_SENT:
            raise RuntimeError("response already started")
        self._state = _DONE
        conn = self._conn
        if conn.closed:
            return
        payload = b"" if self.head.method == b"HEAD" else body
        conn.transport.write(b"%s%s%sContent-Length: %d\r\n%s%s" % (
            status_line(status), headers, date_header(), len(body), self._end_head(), payload))

    def start_stream(self, status: int, headers: bytes) -> None:
        """Send the head of a streamed response; raises ConnectionError if the client left."""
        if self._state != _NOTHING_SENT:
            raise RuntimeError("response already started")
        self._state = _STREAMING
        conn = self._conn
        if conn.closed:
            raise ConnectionResetError("client disconnected")
        if self._chunked:
            framing = b"Transfer-Encoding: chunked\r\n" + self._end_head()
        else:  # HTTP/1.0: the body ends when the connection closes
            framing = b"Connection: close\r\n\r\n"
            conn.close_after_response()
        conn.transport.write(status_line(status) + headers + date_header() + framing)

    async def write(self, data: bytes) -> None:
        """Send part of a streamed body; waits while the client reads slowly.

        Raises ConnectionError when the client has gone."""
        conn = self._conn
        if conn.closed:
            raise ConnectionResetError("client disconnected")
        if data:
            conn.transport.write(encode_chunk(data) if self._chunked else data)
        if conn.write_paused:
            await conn.drain()

    def end_stream(self) -> None:
        """Finish a streamed body cleanly."""
        self._state = _DONE
        conn = self._conn
        if self._chunked and not conn.closed:
            conn.transport.write(LAST_CHUNK)

    def abort(self) -> None:
        """End the response without a clean end, so the client sees it truncated."""
        self._state = _DONE
        self._conn.close_now()


class _Connection(asyncio.Protocol):
    """One client connection: reads requests, runs the handler, keeps the connection alive."""

    def __init__(self, listener: HttpListener) -> None:
        self._listener = listener
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self._buf = bytearray()
        self._scanned = 0  # how far the buffer was searched for the end of a head
        self._head: RequestHead | None = None  # parsed head whose body is still arriving
        self._decoder: ChunkedDecoder | None = None
        self._parts: list[bytes] = []
        self._parts_len = 0
        self._sent_continue = False
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._reading_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.write_paused = False
        self._idle_since = self._loop.time()
        self._timer = self._loop.call_later(CLIENT_IDLE_TIMEOUT_S, self._check_idle)

    @property
    def busy(self) -> bool:
        return self._task is not None

    @property
    def keeps_alive(self) -> bool:
        return not self._closing and not self._listener.stopping

    # -- asyncio callbacks --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._listener.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._timer.cancel()
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self._listener.forget(self)

    def eof_received(self) -> bool | None:
        self._closing = True
        return True if self.busy else None  # let the current response finish

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if self._task is not None:
            if len(self._buf) > MAX_PIPELINED_BYTES and not self._reading_paused:
                self.transport.pause_reading()
                self._reading_paused = True
            return
        self._idle_since = self._loop.time()
        self._next_request()

    # -- reading requests ---------------------------------------------------------------

    def _next_request(self) -> None:
        buf = self._buf
        try:
            if self._head is None:
                while buf[:2] == b"\r\n":  # stray line ends between requests are allowed
                    del buf[:2]
                end = buf.find(b"\r\n\r\n", self._scanned)
                if end < 0:
                    if len(buf) > MAX_HEAD_BYTES:
                        raise HttpError(431, f"request head is larger than {MAX_HEAD_BYTES} bytes")
                    self._scanned = max(0, len(buf) - 3)
                    return
                if end > MAX_HEAD_BYTES:
                    raise HttpError(431, f"request head is larger than {MAX_HEAD_BYTES} bytes")
                head = parse_request_head(bytes(buf[:end]))
                del buf[:end + 4]
                self._scanned = 0
                if head.content_length > CLIENT_MAX_BODY_BYTES:
                    raise HttpError(413, f"request body of {head.content_length} bytes is larger "
                                         f"than the limit of {CLIENT_MAX_BODY_BYTES}")
                self._head = head
                self._sent_continue = False
                if head.chunked:
                    self._decoder = ChunkedDecoder()
                    self._parts = []
                    self._parts_len = 0
            head = self._head
            body = self._take_body(head)
        except HttpError as err:
            self._fail(err)
            return
        if body is None:
            if head.expect_continue and not self._sent_continue:
                self._sent_continue = True
                self.transport.write(_CONTINUE)
            return
        self._head = None
        self._task = self._loop.create_task(self._run(Request(self, head, body)))

    def _take_body(self, head: RequestHead) -> bytes | None:
        buf = self._buf
        decoder = self._decoder
        if decoder is None:
            n = head.content_length
            if len(buf) < n:
                return None
            body = bytes(buf[:n])
            del buf[:n]
            return body
        if buf:
            pieces, rest = decoder.feed(bytes(buf))
            buf.clear()
            self._parts += pieces
            self._parts_len += sum(map(len, pieces))
            if self._parts_len > CLIENT_MAX_BODY_BYTES:
                raise HttpError(413, f"request body is larger than the limit of "
                                     f"{CLIENT_MAX_BODY_BYTES} bytes")
            if decoder.done:
                buf += rest
                self._decoder = None
                body = b"".join(self._parts)
                self._parts = []
                return body
        return None

    def _fail(self, err: HttpError) -> None:
        """Answer a request that cannot be read, then close (the stream's framing is lost)."""
        body = openai_error_body(err.message, "invalid_request_error", "bad_http_request")
        self.transport.write(b"%s%s%sContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (
            status_line(err.status), JSON_HEADERS, date_header(), len(body), body))
        self.close_now()

    # -- running the handler ------------------------------------------------------------

    async def _run(self, request: Request) -> None:
        try:
            await self._listener.handler(request)
            if not request.answered:
                raise RuntimeError("handler returned without answering")
            if request._state == _STREAMING:
                request.abort()  # a stream the handler did not end is cut, never left open
        except asyncio.CancelledError:
            self.close_now()
            raise
        except Exception:
            log.exception("gateway: handling %s %s failed", request.method.decode("latin-1"),
                          request.path)
            if request.answered:
                self.close_now()
            else:
                request.respond(500, openai_error_body(
                    "The gateway failed while handling this request.", "internal_error",
                    "internal_error"))
        finally:
            self._task = None
            self._after_response(request)

    def _after_response(self, request: Request) -> None:
        if self.closed:
            return
        if not request.head.keep_alive or not self.keeps_alive:
            self.close_now()
            return
        self._idle_since = self._loop.time()
        if self._reading_paused:
            self._reading_paused = False
            self.transport.resume_reading()
        if self._buf:
            self._next_request()

    async def drain(self) -> None:
        """Wait until the client's socket buffer has room; ConnectionError if it left."""
        if self.write_paused and not self.closed:
            waiter = self._drain_waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._drain_waiter = None
        if self.closed:
            raise ConnectionResetError("client disconnected")

    # -- closing ------------------------------------------------------------------------

    def close_after_response(self) -> None:
        self._closing = True

    def close_now(self) -> None:
        """Close after what was written so far is flushed; nothing more is written."""
        self._closing = True
        if not self.closed:
            self.closed = True
            self.transport.close()

    def cancel(self) -> asyncio.Task[None] | None:
        """Stop the request in progress (shutdown past its grace) and close."""
        task = self._task
        if task is not None:
            task.cancel()
        self.transport.abort()
        return task

    def _check_idle(self) -> None:
        if self.closed:
            return
        delay = CLIENT_IDLE_TIMEOUT_S
        if self._task is None:
            idle_s = self._loop.time() - self._idle_since
            if idle_s >= CLIENT_IDLE_TIMEOUT_S:
                self.close_now()
                return
            delay -= idle_s
        self._timer = self._loop.call_later(delay, self._check_idle)


class HttpListener:
    """Accepts client connections on one address and runs `handler` for each request."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections: set[_Connection] = set()
        self.stopping = False
        self._server: asyncio.Server | None = None
        self._all_closed: asyncio.Event | None = None

    async def start(self, host: str, port: int, backlog: int = 1024) -> int:
        """Listen on host:port (port 0: any free port); returns the port. Raises OSError."""
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Connection(self), host, port, backlog=backlog, reuse_address=True)
        return int(self._server.sockets[0].getsockname()[1])

    def forget(self, conn: _Connection) -> None:
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
