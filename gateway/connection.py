"""One client connection of the gateway's HTTP/1.1 listener, on a plain asyncio protocol.

Each connection handles one request at a time (pipelined requests wait in its
buffer, and reading pauses once a small amount is waiting) and hands it to the
handler as a `gearshift.gateway.request.Request`. Framing errors get an
OpenAI-shaped JSON error and the connection is closed.

Every client is bounded (`gearshift.gateway.limits.ClientLimits`): the number of
open connections; the request bytes buffered across all connections (a shared
budget: a body's length is reserved before it is read, and an unfinished head or
pipelined requests past a small allowance count too); the time a head may take, the
pace a body must keep after a grace period, and how long a connection may sit
idle. The idle clock starts when a response ends and is not restarted by bytes
that do not complete a request, so a client trickling one byte at a time is cut
by the head deadline. Refusals are counted through `on_refusal(reason)`.

Why not aiohttp's server: see `gearshift.gateway.http11`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from gearshift.gateway.errors import error_body
from gearshift.gateway.http11 import (
    MAX_HEAD_BYTES,
    ChunkedDecoder,
    HttpError,
    RequestHead,
    parse_request_head,
)
from gearshift.gateway.limits import CONNECTION_LIMIT, refusal_reason
from gearshift.gateway.request import STREAMING, Request, error_response

if TYPE_CHECKING:
    from gearshift.gateway.listener import HttpListener

log = logging.getLogger(__name__)

MAX_PIPELINED_BYTES = 64 * 1024  # stop reading from a client that sends this far ahead
# Bytes a connection may buffer outside a body (an unfinished head, requests pipelined
# behind the one in progress) before they count against the shared budget too.
BUFFER_FREE_BYTES = 8 * 1024
BODY_CHECK_INTERVAL_S = 1.0  # how often a body in progress is checked against the minimum rate
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

# Connection phases: what the deadline timer checks.
_IDLE, _HEAD, _BODY, _BUSY = range(4)

class ClientConnection(asyncio.Protocol):
    """One client connection: reads requests, runs the handler, keeps the connection alive."""

    def __init__(self, listener: HttpListener) -> None:
        self._listener = listener
        self._limits = listener.limits
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self._buf = bytearray()
        self._scanned = 0  # how far the buffer was searched for the end of a head
        self._head: RequestHead | None = None  # parsed head whose body is still arriving
        self._decoder: ChunkedDecoder | None = None
        self._parts: list[bytes] = []
        self._parts_len = 0
        self._reserved = 0  # body bytes reserved from the listener's budget
        self._buf_charged = 0  # buffered bytes past BUFFER_FREE_BYTES charged to the budget
        self._sent_continue = False
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._reading_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.write_paused = False
        self._phase = _IDLE
        self._phase_at = self._loop.time()
        self._body_bytes = 0  # bytes received since the body phase began
        self._timer: asyncio.TimerHandle | None = None
        self._timer_phase = _IDLE  # the phase the timer was armed for

    @property
    def busy(self) -> bool:
        return self._task is not None

    @property
    def keeps_alive(self) -> bool:
        return not self._closing and not self._listener.stopping

    # -- asyncio callbacks --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        listener = self._listener
        if len(listener.connections) >= self._limits.max_connections:
            listener.refused(CONNECTION_LIMIT)
            self.closed = True
            self.transport.write(error_response(
                503, f"The gateway has {self._limits.max_connections} client connections "
                     "open, its limit; retry shortly.", "too_many_connections"))
            self.transport.close()
            return
        listener.connections.add(self)
        self._timer = self._loop.call_at(self._phase_at + self._limits.idle_timeout_s,
                                         self._check_deadline)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._task is None:
            self._release_body()  # a handler still running holds its body until it returns
        self._charge_buffer(0)
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
        if self.closed:
            return
        self._buf += data
        if self._task is not None:
            if len(self._buf) > BUFFER_FREE_BYTES:
                self._charge_buffer(len(self._buf), force=True)
            if len(self._buf) > MAX_PIPELINED_BYTES and not self._reading_paused:
                self.transport.pause_reading()
                self._reading_paused = True
            return
        if self._phase == _BODY:
            self._body_bytes += len(data)
        self._next_request()
        if self._phase != self._timer_phase and self._phase in (_HEAD, _BODY) \
                and not self.closed:
            self._arm()

    # -- reading requests ---------------------------------------------------------------

    def _next_request(self) -> None:
        buf = self._buf
        try:
            head = self._head
            if head is None:
                if self._phase == _IDLE:  # the first byte of a head starts its deadline
                    self._phase = _HEAD
                    self._phase_at = self._loop.time()
                while buf[:2] == b"\r\n":  # stray line ends between requests are allowed
                    del buf[:2]
                end = buf.find(b"\r\n\r\n", self._scanned)
                if end < 0:
                    if len(buf) > MAX_HEAD_BYTES:
                        raise HttpError(431, f"request head is larger than {MAX_HEAD_BYTES} bytes")
                    self._scanned = max(0, len(buf) - 3)
                    if len(buf) > BUFFER_FREE_BYTES and not self._charge_buffer(len(buf)):
                        raise HttpError(503, "The gateway holds as many request bytes as it "
                                             "may right now; retry shortly.")
                    return
                if end > MAX_HEAD_BYTES:
                    raise HttpError(431, f"request head is larger than {MAX_HEAD_BYTES} bytes")
                head = parse_request_head(bytes(buf[:end]))
                del buf[:end + 4]
                self._scanned = 0
                if self._buf_charged:  # what is left is body, covered by its own reservation
                    self._charge_buffer(0)
                self._start_body(head)
            body = self._take_body(head)
        except HttpError as err:
            self._fail(err)
            return
        if body is None:
            if self._phase != _BODY:
                self._phase = _BODY
                self._phase_at = self._loop.time()
                self._body_bytes = self._parts_len + len(buf)
            if head.expect_continue and not self._sent_continue:
                self._sent_continue = True
                self.transport.write(_CONTINUE)
            return
        self._head = None
        self._phase = _BUSY
        if len(buf) > BUFFER_FREE_BYTES:  # requests pipelined behind this one
            self._charge_buffer(len(buf), force=True)
        self._task = self._loop.create_task(self._run(Request(self, head, body)))

    def _start_body(self, head: RequestHead) -> None:
        limits = self._limits
        n = head.content_length
        if n > limits.max_body_bytes:
            raise HttpError(413, f"request body of {n} bytes is larger than the limit of "
                                 f"{limits.max_body_bytes}")
        if n and not self._reserve(n):
            raise HttpError(503, "The gateway holds as many request bodies as it may right "
                                 "now; retry shortly.")
        self._head = head
        self._sent_continue = False
        if head.chunked:
            self._decoder = ChunkedDecoder()
            self._parts = []
            self._parts_len = 0

    def _reserve(self, n: int) -> bool:
        if not self._listener.budget.take(n):
            return False
        self._reserved += n
        return True

    def _charge_buffer(self, buffered: int, force: bool = False) -> bool:
        """Charge `buffered` bytes, past the free allowance, to the budget (0: give all back).

        False when the budget cannot take them (unless `force`: bytes already in memory
        behind a request in progress are counted even past the limit)."""
        want = max(0, buffered - BUFFER_FREE_BYTES)
        delta = want - self._buf_charged
        budget = self._listener.budget
        if delta > 0 and not budget.take(delta):
            if not force:
                return False
            budget.used += delta
        elif delta < 0:
            budget.give(-delta)
        self._buf_charged = want
        return True

    def _release_body(self) -> None:
        if self._reserved:
            self._listener.budget.give(self._reserved)
            self._reserved = 0

    def _take_body(self, head: RequestHead) -> bytes | None:
        buf = self._buf
        decoder = self._decoder
        if decoder is None:
            n = head.content_length
            if len(buf) < n:
                return None
            if len(buf) == n:
                body = bytes(buf)
                buf.clear()
            else:
                body = bytes(memoryview(buf)[:n])
                del buf[:n]
            return body
        if buf:
            pieces, rest = decoder.feed(bytes(buf))
            buf.clear()
            got = sum(map(len, pieces))
            if self._parts_len + got > self._limits.max_body_bytes:
                raise HttpError(413, f"request body is larger than the limit of "
                                     f"{self._limits.max_body_bytes} bytes")
            if got and not self._reserve(got):
                raise HttpError(503, "The gateway holds as many request bodies as it may "
                                     "right now; retry shortly.")
            self._parts += pieces
            self._parts_len += got
            if decoder.done:
                buf += rest
                self._decoder = None
                body = b"".join(self._parts)
                self._parts = []
                return body
        return None

    def _fail(self, err: HttpError) -> None:
        """Answer a request that cannot be read, then close (the stream's framing is lost)."""
        self._listener.refused(refusal_reason(err.status))
        code = "server_busy" if err.status == 503 else "bad_http_request"
        self.transport.write(error_response(err.status, err.message, code))
        self.close_now()

    # -- deadlines --------------------------------------------------------------------

    def _arm(self) -> None:
        """Re-arm the timer for the phase just entered (a head or body in progress)."""
        if self._timer is not None:
            self._timer.cancel()
        phase = self._phase
        self._timer_phase = phase
        limits = self._limits
        if phase == _HEAD:
            due = self._phase_at + limits.head_timeout_s
        elif phase == _BODY:
            due = self._phase_at + limits.body_grace_s
        else:
            due = self._phase_at + limits.idle_timeout_s
        self._timer = self._loop.call_at(due, self._check_deadline)

    def _check_deadline(self) -> None:
        if self.closed:
            return
        now = self._loop.time()
        limits = self._limits
        phase = self._phase
        self._timer_phase = phase
        if phase == _IDLE:
            due = self._phase_at + limits.idle_timeout_s
            if now >= due:
                self.close_now()
                return
        elif phase == _HEAD:
            due = self._phase_at + limits.head_timeout_s
            if now >= due:
                self._fail(HttpError(408, f"the request head did not arrive within "
                                          f"{limits.head_timeout_s:g} s"))
                return
        elif phase == _BODY:
            paced_s = now - self._phase_at - limits.body_grace_s
            if paced_s >= 0 and self._body_bytes < limits.body_min_rate_bps * paced_s:
                self._fail(HttpError(408, f"the request body arrived slower than "
                                          f"{limits.body_min_rate_bps:g} bytes/s"))
                return
            due = now + BODY_CHECK_INTERVAL_S
        else:  # a handler is running: the upstream's timeouts bound it
            due = now + limits.idle_timeout_s
        self._timer = self._loop.call_at(due, self._check_deadline)

    # -- running the handler ------------------------------------------------------------

    async def _run(self, request: Request) -> None:
        try:
            await self._listener.handler(request)
            if not request.answered:
                raise RuntimeError("handler returned without answering")
            if request.state == STREAMING:
                request.abort()  # a stream the handler did not end is cut, never left open
        except asyncio.CancelledError:
            self.close_now()
            raise
        except Exception:
            log.exception("gateway: handling %s %s failed", request.method[:20].decode("latin-1"),
                          request.path[:100])
            if request.answered:
                self.close_now()
            else:
                request.respond(500, error_body(
                    500, "The gateway failed while handling this request.", "internal_error"))
        finally:
            self._task = None
            request.body = b""
            self._release_body()
            self._after_response(request)

    def _after_response(self, request: Request) -> None:
        if self.closed:
            return
        if not request.head.keep_alive or not self.keeps_alive:
            self.close_now()
            return
        self._phase = _IDLE
        self._phase_at = self._loop.time()
        if self._buf_charged:
            self._charge_buffer(0)
        if self._reading_paused:
            self._reading_paused = False
            self.transport.resume_reading()
        if self._buf:
            self._next_request()
            if self._phase != self._timer_phase and self._phase in (_HEAD, _BODY) \
                    and not self.closed:
                self._arm()

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
