"""One client request as the handler sees it, and the means to answer it.

A `Request` answers whole (`respond`) or streamed (`start_stream`, `write`,
`end_stream`, or `abort` to cut it so the client sees a truncated body). A stream
is chunked, or carries the upstream's Content-Length when one is given; `write`
waits while the client's socket buffer is full, so a slow reader slows its own
stream instead of filling the gateway's memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gearshift.gateway.errors import error_body
from gearshift.gateway.http11 import (
    LAST_CHUNK,
    RequestHead,
    date_header,
    encode_chunk,
    status_line,
)

if TYPE_CHECKING:
    from gearshift.gateway.connection import ClientConnection

JSON_HEADERS = b"Content-Type: application/json\r\n"

NOTHING_SENT, STREAMING, DONE = range(3)


def error_response(status: int, message: str, code: str) -> bytes:
    """A whole error response that closes the connection (the request could not be read)."""
    body = error_body(status, message, code)
    return b"%s%s%sContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (
        status_line(status), JSON_HEADERS, date_header(), len(body), body)


class Request:
    """One request on a client connection, and the means to answer it."""

    __slots__ = ("_chunked", "_conn", "body", "head", "state")

    def __init__(self, conn: ClientConnection, head: RequestHead, body: bytes) -> None:
        self.head = head
        self.body = body
        self._conn = conn
        self.state = NOTHING_SENT
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
        return self.state != NOTHING_SENT

    def _end_head(self) -> bytes:
        keep = self.head.keep_alive and self._conn.keeps_alive
        if not keep:
            return b"Connection: close\r\n\r\n"
        return b"\r\n" if self.head.http11 else b"Connection: keep-alive\r\n\r\n"

    def respond(self, status: int, body: bytes, headers: bytes = JSON_HEADERS) -> None:
        """Send a whole response; `headers` is a block of `Name: value\\r\\n` lines."""
        if self.state != NOTHING_SENT:
            raise RuntimeError("response already started")
        self.state = DONE
        conn = self._conn
        if conn.closed:
            return
        payload = b"" if self.head.method == b"HEAD" else body
        conn.transport.write(b"%s%s%sContent-Length: %d\r\n%s%s" % (
            status_line(status), headers, date_header(), len(body), self._end_head(), payload))

    def start_stream(self, status: int, headers: bytes, length: int | None = None) -> None:
        """Send the head of a streamed response; raises ConnectionError if the client left.

        With `length` the body is framed by that Content-Length (a stream cut short then
        shows as a short body); without it, chunked (HTTP/1.1) or until close (HTTP/1.0)."""
        if self.state != NOTHING_SENT:
            raise RuntimeError("response already started")
        self.state = STREAMING
        conn = self._conn
        if conn.closed:
            raise ConnectionResetError("client disconnected")
        if length is not None:
            self._chunked = False
            framing = b"Content-Length: %d\r\n%s" % (length, self._end_head())
        elif self._chunked:
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
        self.state = DONE
        conn = self._conn
        if self._chunked and not conn.closed:
            conn.transport.write(LAST_CHUNK)

    def abort(self) -> None:
        """End the response without a clean end, so the client sees it truncated."""
        self.state = DONE
        self._conn.close_now()
