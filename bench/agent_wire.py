"""The ingest bench's simulated agents on the wire: gRPC streams over HTTP/2, written by hand.

gRPC's asyncio client spends about as much CPU per message as the controller's server
does (a completion-queue round trip, a poller-thread wake-up and futures for every read
and write: about 0.5 ms a report on a slow machine), so simulated agents built on it took
half of a 2-core machine from the controller they were measuring. The controller cannot
tell these streams from a real agent's: the same HTTP/2 frames (one HEADERS to open a
stream, one DATA frame per length-prefixed message, in both directions, or several for a
message larger than the windows or the server's frame size) on a TCP
connection that many agents share, as `--agents-per-channel` streams did on a gRPC
channel. What gRPC's client did besides, this does too, as far as the controller can see:
it answers the server's SETTINGS and PINGs, honours its flow-control windows (a message
waits for a WINDOW_UPDATE rather than overrun them) and reads the trailers of a stream the
server ends (its `grpc-status` and `grpc-message`, decoded with `hpack`). It opens the
connection with gRPC's client's SETTINGS and window, and each stream with its headers
(user agent included), and gives back the window of each message it reads with two
WINDOW_UPDATEs (the stream's and the connection's), as that client does; like the
simulator's gRPC calls, it asks for no compression and sends no deadline. Seen through
a proxy, 2,000 reports on 100 streams brought the same frames each way with either
client (per report, the report and two WINDOW_UPDATEs from the client, the ack and three
WINDOW_UPDATEs from the server), except gRPC's client's own BDP pings (11 and their
acks), which this one does not send.

One `Connection` per TCP connection, a protocol on the event loop; per stream the caller
gives a `StreamHandler` (called back with each message and with the stream's end), so a
report costs one frame written and one callback, with no task, future or timer of gRPC's.
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import unquote

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    0, 1, 3, 4, 6, 7, 8, 9)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
DEFAULT_MAX_FRAME = 16_384
DEFAULT_WINDOW = 65_535
# What gRPC's C core client (1.85) sends first, copied so that the server sees the same:
# SETTINGS (no push, no streams from the server, 4 MiB windows and frames, 16 KB of
# headers, binary metadata allowed) and a connection window of 4 MiB.
CLIENT_WINDOW = 4 * 1024 * 1024
CLIENT_SETTINGS = ((0x2, 0), (0x3, 0), (SETTINGS_INITIAL_WINDOW_SIZE, CLIENT_WINDOW),
                   (0x5, CLIENT_WINDOW), (0x6, 16_384), (0xFE03, 1))
USER_AGENT = b"grpc-python-asyncio/1.85.3 grpc-c/58.0.0 (linux; chttp2)"
RST_CANCEL = 0x8
# gRPC's status codes by number (grpc.StatusCode's names, without importing grpc here).
STATUS_NAMES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
                "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")


def frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    """One HTTP/2 frame: 9 bytes of header, then the payload."""
    return struct.pack(">IBBI", len(payload), kind, flags, stream_id)[1:] + payload


def _literal(name_index: int, value: bytes) -> bytes:
    """HPACK: a header field without indexing, its name from the static table, the value
    as a plain (not Huffman-coded) string; every index and length here is under 127."""
    prefix = bytes((name_index,)) if name_index < 15 else bytes((15, name_index - 15))
    return prefix + bytes((len(value),)) + value


def request_headers(authority: str, path: str) -> bytes:
    """The HPACK block that opens a gRPC call (the same for every stream: no dynamic
    table is used, so the server's decoder state never depends on the order of streams)."""
    return (b"\x83"  # :method POST (static 3)
            + b"\x86"  # :scheme http (static 6)
            + _literal(4, path.encode())  # :path
            + _literal(1, authority.encode())  # :authority
            + _literal(31, b"application/grpc")  # content-type
            + b"\x00\x02te\x08trailers"  # te: trailers (a new name)
            + b"\x00\x14grpc-accept-encoding\x17identity, deflate, gzip"
            + _literal(58, USER_AGENT))  # user-agent, as gRPC's client


class StreamHandler(Protocol):
    def on_message(self, data: bytes) -> None:
        """One gRPC message from the server (serialized)."""

    def on_end(self, error: str) -> None:
        """The stream is over: the server's status (`CODE: message`), or why it broke."""


class Connection(asyncio.Protocol):
    """One HTTP/2 connection to a gRPC server carrying many bidirectional streams."""

    def __init__(self, authority: str, path: str) -> None:
        from hpack import Decoder  # only for the server's headers: once a stream, not a message

        self._headers = request_headers(authority, path)
        self._decoder = Decoder()
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._next_id = 1
        self._streams: dict[int, StreamHandler] = {}
        self._inbox: dict[int, bytearray] = {}  # a stream's bytes of messages not yet whole
        self._send_window = DEFAULT_WINDOW  # the connection's
        self._stream_windows: dict[int, int] = {}
        self._initial_window = DEFAULT_WINDOW  # the server's, for new streams
        self._waiting: deque[tuple[int, bytes]] = deque()  # DATA not yet in the windows
        self._max_frame = DEFAULT_MAX_FRAME  # the server's SETTINGS_MAX_FRAME_SIZE
        self._header_block: tuple[int, int, bytearray] | None = None  # stream, flags, block
        self.ready = asyncio.get_running_loop().create_future()
        self.lost: str | None = None
        self.pings = 0  # PINGs the server sent (not acks of ours: this side sends none)

    # -- the caller's side
    def open_stream(self, handler: StreamHandler) -> int:
        """Start a call (HEADERS); returns its stream id."""
        if self._transport is None or self.lost is not None:
            raise ConnectionError(self.lost or "not connected")
        sid = self._next_id
        self._next_id += 2
        self._streams[sid] = handler
        self._stream_windows[sid] = self._initial_window
        self._transport.write(frame(HEADERS, END_HEADERS, sid, self._headers))
        return sid

    def send(self, sid: int, message: bytes) -> None:
        """One gRPC message (uncompressed) on a stream: a DATA frame, now if the windows
        and the server's frame size allow; else in frames as large as they allow, each
        once the server's WINDOW_UPDATEs have opened the windows for it."""
        payload = b"\x00" + struct.pack(">I", len(message)) + message
        if self._waiting or not self._fits(sid, len(payload)) or len(payload) > self._max_frame:
            self._waiting.append((sid, payload))
            self._flush_waiting()
            return
        self._write_data(sid, payload)

    def cancel(self, sid: int) -> None:
        """End a stream from this side (RST_STREAM CANCEL), as a cancelled call does."""
        if self._streams.pop(sid, None) is not None and self._transport is not None \
                and self.lost is None:
            self._transport.write(frame(RST_STREAM, 0, sid, struct.pack(">I", RST_CANCEL)))
        self._inbox.pop(sid, None)
        self._stream_windows.pop(sid, None)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # -- flow control of what this side sends
    def _fits(self, sid: int, n: int) -> bool:
        return n <= self._send_window and n <= self._stream_windows.get(sid, 0)

    def _write_data(self, sid: int, payload: bytes) -> None:
        n = len(payload)
        self._send_window -= n
        self._stream_windows[sid] -= n
        assert self._transport is not None
        self._transport.write(frame(DATA, 0, sid, payload))

    def _flush_waiting(self) -> None:
        """Write what waits, in order, as far as the windows allow: a message larger than
        they are goes in parts (the server grants the rest once it has read the start)."""
        while self._waiting:
            sid, payload = self._waiting[0]
            if sid not in self._streams:  # ended meanwhile
                self._waiting.popleft()
                continue
            n = min(len(payload), self._max_frame, self._send_window,
                    self._stream_windows.get(sid, 0))
            if n <= 0:
                return
            if n < len(payload):
                self._waiting[0] = (sid, payload[n:])
                self._write_data(sid, payload[:n])
                continue
            self._waiting.popleft()
            self._write_data(sid, payload)

    # -- asyncio.Protocol
    def connection_made(self, transport: Any) -> None:
        self._transport = transport
        settings = b"".join(struct.pack(">HI", k, v) for k, v in CLIENT_SETTINGS)
        transport.write(PREFACE + frame(SETTINGS, 0, 0, settings) + frame(
            WINDOW_UPDATE, 0, 0, struct.pack(">I", CLIENT_WINDOW - DEFAULT_WINDOW)))
        if not self.ready.done():
            self.ready.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = f"connection lost: {exc!r}" if exc else "connection closed"
        self._end_all(self.lost)
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(self.lost))

    def _end_all(self, error: str, above: int = 0) -> None:
        for sid in [s for s in self._streams if s > above]:
            self._end(sid, error)

    def _end(self, sid: int, error: str) -> None:
        handler = self._streams.pop(sid, None)
        self._inbox.pop(sid, None)
        self._stream_windows.pop(sid, None)
        if handler is not None:
            handler.on_end(error)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos, end = 0, len(buf)
        while end - pos >= 9:
            length = int.from_bytes(buf[pos:pos + 3], "big")
            if end - pos < 9 + length:
                break
            kind, flags = buf[pos + 3], buf[pos + 4]
            sid = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
            payload = bytes(buf[pos + 9:pos + 9 + length])
            pos += 9 + length
            if kind == DATA:
                self._on_data(sid, flags, payload)
            else:
                self._on_control(kind, flags, sid, payload)
        del buf[:pos]

    # -- frames from the server
    def _on_data(self, sid: int, flags: int, payload: bytes) -> None:
        if payload:  # gives the window back at once, for the stream and the connection
            increment = struct.pack(">I", len(payload))
            assert self._transport is not None
            self._transport.write(frame(WINDOW_UPDATE, 0, sid, increment)
                                  + frame(WINDOW_UPDATE, 0, 0, increment))
        if flags & PADDED:
            payload = payload[1:len(payload) - payload[0]]
        handler = self._streams.get(sid)
        if handler is not None:
            inbox = self._inbox.get(sid)
            if inbox is None and len(payload) >= 5 \
                    and len(payload) == 5 + int.from_bytes(payload[1:5], "big"):
                handler.on_message(payload[5:])  # the usual case: one whole message
            else:
                if inbox is None:
                    inbox = self._inbox[sid] = bytearray()
                inbox += payload
                while len(inbox) >= 5 and len(inbox) >= 5 + int.from_bytes(inbox[1:5], "big"):
                    n = 5 + int.from_bytes(inbox[1:5], "big")
                    message = bytes(inbox[5:n])
                    del inbox[:n]
                    handler.on_message(message)
                if not inbox:
                    self._inbox.pop(sid, None)
        if flags & END_STREAM:
            self._end(sid, "the server ended the stream without a status")

    def _on_control(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        assert self._transport is not None
        if kind in (HEADERS, CONTINUATION):
            self._on_headers(kind, flags, sid, payload)
        elif kind == SETTINGS:
            if not flags & ACK:
                for i in range(0, len(payload) - 5, 6):
                    key, value = struct.unpack(">HI", payload[i:i + 6])
                    if key == SETTINGS_MAX_FRAME_SIZE:
                        self._max_frame = value
                    if key == SETTINGS_INITIAL_WINDOW_SIZE:
                        delta = value - self._initial_window
                        self._initial_window = value
                        for s in self._stream_windows:
                            self._stream_windows[s] += delta
                self._transport.write(frame(SETTINGS, ACK, 0, b""))
                self._flush_waiting()
        elif kind == PING:
            if not flags & ACK:
                self.pings += 1
                self._transport.write(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            increment = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            if sid == 0:
                self._send_window += increment
            elif sid in self._stream_windows:
                self._stream_windows[sid] += increment
            self._flush_waiting()
        elif kind == RST_STREAM:
            code = int.from_bytes(payload[:4], "big")
            self._end(sid, f"RST_STREAM from the server (HTTP/2 error {code})")
        elif kind == GOAWAY:
            last, code = struct.unpack(">II", payload[:8])
            self._end_all(f"GOAWAY from the server (HTTP/2 error {code}: "
                          f"{payload[8:].decode(errors='replace')})", above=last & 0x7FFFFFFF)

    def _on_headers(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if kind == HEADERS:
            if flags & PADDED:
                payload = payload[1:len(payload) - payload[0]]
            if flags & PRIORITY:
                payload = payload[5:]
            self._header_block = (sid, flags, bytearray(payload))
        elif self._header_block is not None:
            self._header_block[2].extend(payload)
        if not flags & END_HEADERS or self._header_block is None:
            return
        sid, first_flags, block = self._header_block
        self._header_block = None
        fields = dict(self._decoder.decode(bytes(block)))  # always: it keeps the table
        if first_flags & END_STREAM:  # trailers (or a trailers-only answer): the status
            code = int(fields.get("grpc-status", 2))
            name = STATUS_NAMES[code] if 0 <= code < len(STATUS_NAMES) else str(code)
            self._end(sid, f"{name}: {unquote(fields.get('grpc-message', ''))}")


async def connect(host: str, port: int, path: str,
                  factory: Callable[[str, str], Connection] = Connection) -> Connection:
    """A connection to `host:port` for calls to `path` (`/package.Service/Method`)."""
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(lambda: factory(f"{host}:{port}", path), host, port)
    await conn.ready
    return conn
