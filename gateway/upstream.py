"""One HTTP/1.1 connection from the gateway to an engine, one exchange at a time.

`UpstreamConnection` writes a serialized request (`send`), parses the response
head (`wait_head`), then hands the body over whole (`read`) or as it arrives
(`readany`). While a streamed body waits for a slow client, reading from the
engine pauses, so nothing piles up in memory. The response head must arrive
within the read timeout of the request going out (bytes that do not complete it
do not extend it); once the body has started, a gap longer than the body timeout
while someone waits ends the exchange; an idle timeout closes the connection
while it sits in the pool (`gearshift.gateway.upstream_pool`). At most
`MAX_INTERIM_RESPONSES` 1xx heads are skipped; 101 and malformed statuses are
protocol errors. Every failure is an
`UpstreamError` (a ConnectionError); `UpstreamConnectError` means the endpoint
could not be reached at all.

Why not aiohttp's client: see `gearshift.gateway.http11`.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from gearshift.gateway.http11 import (
    MAX_HEAD_BYTES,
    MAX_INTERIM_RESPONSES,
    ChunkedDecoder,
    HttpError,
    ResponseHead,
    parse_response_head,
)

if TYPE_CHECKING:
    from gearshift.gateway.upstream_pool import UpstreamPool

# (host, port, tls)
UpstreamKey = tuple[str, int, bool]

READ_PAUSE_BYTES = 256 * 1024  # body bytes buffered for a slow reader before reading pauses


class UpstreamError(ConnectionError):
    """The exchange with an engine failed; the message says how."""


class UpstreamConnectError(UpstreamError):
    """The engine's endpoint could not be reached (refused, unreachable)."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """The engine did not answer (connect or read) in time."""


_IDLE, _HEAD, _BODY, _DONE = range(4)


class UpstreamConnection(asyncio.Protocol):
    """One connection to an engine, carrying one request/response exchange at a time."""

    def __init__(self, pool: UpstreamPool, key: UpstreamKey) -> None:
        self._pool = pool
        self.key = key
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.head: ResponseHead | None = None
        self.closed = False
        self.reused = False  # this exchange is not the connection's first
        self.got_data = False  # any byte of this exchange's response arrived
        self._state = _IDLE
        self._buf = bytearray()
        self._remaining: int | None = None
        self._decoder: ChunkedDecoder | None = None
        self._chunks: list[bytes] = []
        self._queued = 0
        self._complete = False
        self._reusable = False
        self._whole = False  # the reader wants the whole body: never pause
        self._paused = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._last = self._loop.time()
        self._sent_at = self._last
        self._interim = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    # -- exchange -------------------------------------------------------------------------

    def send(self, data: bytes, body: bytes = b"") -> None:
        """Start an exchange: write the serialized request (a large body apart, uncopied)."""
        self._state = _HEAD
        self.head = None
        self.got_data = False
        self._buf.clear()
        self._remaining = None
        self._decoder = None
        self._chunks = []
        self._queued = 0
        self._complete = False
        self._reusable = False
        self._whole = False
        self._error = None
        self._interim = 0
        self._last = self._sent_at = self._loop.time()
        if self._timer is None:
            self._arm(self._last + min(self._pool.idle_timeout_s, self._pool.read_timeout_s))
        self.transport.write(data)
        if body:
            self.transport.write(body)

    async def wait_head(self) -> ResponseHead:
        while self.head is None:
            if self._error is not None:
                raise self._error
            await self._wait()
        return self.head

    async def read(self) -> bytes:
        """The whole body (for responses with a length)."""
        self._whole = True
        if self._paused:
            self._paused = False
            self.transport.resume_reading()
        while not self._complete:
            if self._error is not None:
                raise self._error
            await self._wait()
        return self._take()

    async def readany(self) -> bytes:
        """Body bytes that arrived since the last call (waiting for some); b"" at the end."""
        while True:
            if self._chunks:
                return self._take()
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait()

    @property
    def at_eof(self) -> bool:
        """The body ended cleanly and everything was read."""
        return self._complete and not self._chunks

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._queued = 0
        if self._paused:
            self._paused = False
            self._last = self._loop.time()  # the pause was the reader's, not the engine's
            self.transport.resume_reading()
        return data

    async def _wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, err: UpstreamError) -> None:
        if self._error is None and not self._complete:
            self._error = err
        self._wake()

    def _finish(self, keep_alive: bool) -> None:
        self._complete = True
        self._state = _DONE
        self._reusable = keep_alive
        self._wake()

    @property
    def reusable(self) -> bool:
        return self._reusable and self._complete and not self._chunks and not self.closed

    def close(self) -> None:
        """Close the connection (an unfinished exchange is abandoned)."""
        self._pool.discard(self)
        if not self.closed:
            self.closed = True
            self.transport.close()

    # -- asyncio callbacks --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        self._pool.discard(self)
        if self._state == _BODY and self._remaining is None and self._decoder is None \
                and exc is None:
            self._finish(keep_alive=False)  # the body ran until the connection closed
        elif self._state in (_HEAD, _BODY):
            where = "before the response head" if self._state == _HEAD else "mid-body"
            self._fail(UpstreamError(f"connection closed by the engine {where}"
                                     + (f" ({exc})" if exc else "")))

    def eof_received(self) -> bool | None:
        self._pool.discard(self)  # the engine is closing it: never hand it out again
        return None

    def data_received(self, data: bytes) -> None:
        self._last = self._loop.time()
        self.got_data = True
        state = self._state
        if state == _BODY:
            self._body(data)
        elif state == _HEAD:
            self._head_data(data)
        else:  # nothing may arrive between exchanges: the framing is lost
            self._reusable = False
            self.close()

    def _head_data(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    self._protocol_error(f"response head larger than {MAX_HEAD_BYTES} bytes")
                return
            if end > MAX_HEAD_BYTES:
                self._protocol_error(f"response head larger than {MAX_HEAD_BYTES} bytes")
                return
            try:
                head = parse_response_head(bytes(buf[:end]))
            except HttpError as err:
                self._protocol_error(err.message)
                return
            del buf[:end + 4]
            if head.status >= 200:
                break  # 1xx heads are interim: the real one follows
            self._interim += 1
            if self._interim > MAX_INTERIM_RESPONSES:
                self._protocol_error(f"more than {MAX_INTERIM_RESPONSES} interim (1xx) "
                                     "responses")
                return
        self.head = head
        self._state = _BODY
        if head.chunked:
            self._decoder = ChunkedDecoder()
        else:
            self._remaining = head.content_length
        self._wake()
        rest = bytes(buf)
        buf.clear()
        if rest or head.content_length == 0:
            self._body(rest)
        if not self._complete and not self.closed:
            # The body is still to come: its gap timeout may be due before the timer.
            due = self._last + self._pool.body_timeout_s
            if self._timer_at > due:
                self._arm(due)

    def _body(self, data: bytes) -> None:
        head = self.head
        assert head is not None
        decoder = self._decoder
        if decoder is not None:
            try:
                pieces, extra = decoder.feed(data)
            except HttpError as err:
                self._protocol_error(err.message)
                return
            for piece in pieces:
                self._add(piece)
            if decoder.done:
                self._finish(head.keep_alive and not extra)
            return
        remaining = self._remaining
        if remaining is None:
            self._add(data)
            return
        if len(data) > remaining:
            self._add(data[:remaining])
            self._finish(keep_alive=False)  # bytes past the body: do not trust the framing
            return
        self._add(data)
        remaining -= len(data)
        self._remaining = remaining
        if remaining == 0:
            self._finish(head.keep_alive)

    def _add(self, piece: bytes) -> None:
        if not piece:
            return
        self._chunks.append(piece)
        self._queued += len(piece)
        self._wake()
        if self._queued > READ_PAUSE_BYTES and not self._whole and not self._paused:
            self._paused = True
            self.transport.pause_reading()

    def _protocol_error(self, message: str) -> None:
        self._fail(UpstreamError(f"bad response from the engine: {message}"))
        self.close()

    def _on_timer(self) -> None:
        """Read timeout during an exchange, idle timeout in the pool; re-armed lazily."""
        if self.closed:
            return
        now = self._loop.time()
        pool = self._pool
        if self._state == _HEAD:
            if now - self._sent_at >= pool.read_timeout_s:
                self._fail(UpstreamTimeout(f"no complete response head from the engine "
                                           f"within {pool.read_timeout_s:g} s"))
                self.close()
                return
            limit = self._sent_at + pool.read_timeout_s
        elif self._state == _BODY:
            if self._waiter is not None and now - self._last >= pool.body_timeout_s:
                self._fail(UpstreamTimeout(f"no body data from the engine for "
                                           f"{pool.body_timeout_s:g} s"))
                self.close()
                return
            limit = self._last + pool.body_timeout_s
        elif self._state == _IDLE:
            if now - self._last >= pool.idle_timeout_s:
                self.close()
                return
            limit = self._last + pool.idle_timeout_s
        else:
            limit = now + pool.idle_timeout_s
        self._arm(min(limit, now + pool.idle_timeout_s))

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._loop.call_at(when, self._on_timer)

    def make_idle(self) -> None:
        self._state = _IDLE
        self.reused = True
        self._last = self._loop.time()
