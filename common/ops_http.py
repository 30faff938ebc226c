"""A small HTTP listener for operators: `/metrics`, `/healthz` (alive), `/readyz` (ready).

Every gearshift daemon (controller, agent, gateway) can run one on the address
given by `--metrics-listen HOST:PORT`, apart from its client-facing ports, so
that a Prometheus scrape or a Kubernetes/systemd probe never needs a client
certificate or a token, and never shares a failure mode with the traffic it
watches. It knows nothing of the process it serves: it is given a Prometheus
registry and readiness (and, optionally, liveness) callbacks.

Deliberately plain and safe to expose: one request per connection (answered
with `Connection: close`), GET and HEAD only, and bodies that carry no secret
(metrics and a one-line reason at most; never configuration, tokens or
addresses of credentials).

Hostile clients (the bounds are `OpsLimits`; defaults, the constants below): as on the
gateway's API port, a request head must be complete within a deadline counted from the
accept, and may not go silent longer than the idle limit; an answer the client does not
take within a send deadline is dropped. One source address (an IPv6 /64) may hold only
so many connections; more from it are answered 503 and closed at once. Probes cannot be
starved: a complete head is answered at once, and a full listener makes room for a new
connection by closing the oldest connection still reading its head, from the source
holding the most such connections. A probe is usually the only connection of its source
(the kubelet's node address), so slow clients from other hosts cannot push it out unless
every slot is theirs, each from a distinct address; a new connection is refused (503 busy)
only while every slot is sending an answer. (A prober sharing its address with as many
slow clients as the per-source limit is refused by that limit.)
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8 * 1024  # a longer request head is answered 400
# From the accept to the head's blank line. Probes and scrapers send their head in one
# packet; a client sending a byte a second holds a slot no longer than this.
HEAD_TIMEOUT_S = 3.0
IDLE_TIMEOUT_S = 1.0  # the longest silence before the head is complete (from accept, too)
SEND_TIMEOUT_S = 10.0  # an answer the client has not taken by then is dropped (a reset)
MAX_CONNECTIONS = 64  # open connections, all sources; when full, see the module docstring
MAX_CONNECTIONS_PER_SOURCE = 16  # open connections from one address; more are refused
IPV6_SOURCE_PREFIX = 64  # IPv6 addresses within one /64 count as one source
# The kernel's queue of connections not yet accepted: when a burst fills it, a probe's SYN
# is dropped and retried a second later, so it is sized for hundreds (capped by somaxconn).
LISTEN_BACKLOG = 1024
STOP_GRACE_S = 1.0  # stop() waits this long for closed connections to be gone
_TEXT = "text/plain; charset=utf-8"

# A readiness or liveness check: True/False, or (ok, one-line reason shown in the body).
Check = Callable[[], "bool | tuple[bool, str]"]


@dataclass(frozen=True, slots=True)
class OpsLimits:
    """What the listener allows its clients; the defaults are the module constants."""

    max_connections: int = MAX_CONNECTIONS
    max_per_source: int = MAX_CONNECTIONS_PER_SOURCE
    head_timeout_s: float = HEAD_TIMEOUT_S
    idle_timeout_s: float = IDLE_TIMEOUT_S
    send_timeout_s: float = SEND_TIMEOUT_S
    max_head_bytes: int = MAX_HEAD_BYTES

    def __post_init__(self) -> None:
        bad = [f"{name} must be > 0, got {getattr(self, name)}"
               for name in ("max_connections", "max_per_source", "head_timeout_s",
                            "idle_timeout_s", "send_timeout_s", "max_head_bytes")
               if getattr(self, name) <= 0]
        if bad:
            raise ValueError("ops listener limits: " + "; ".join(bad))


def parse_listen(value: str, flag: str = "--metrics-listen") -> tuple[str, int]:
    """HOST:PORT (IPv6 in brackets) -> (host, port); ValueError names the flag and value."""
    host, sep, port_s = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise ValueError(f"{flag}: expected HOST:PORT with a port in 0..65535, found {value!r}")
    return host, int(port_s)


def _response(status: str, body: bytes, content_type: str = _TEXT,
              head_only: bool = False) -> bytes:
    head = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\n"
            "Connection: close\r\n\r\n").encode()
    return head if head_only else head + body


_BAD_REQUEST = _response("400 Bad Request", b"bad request\n")
_TOO_SLOW = _response("408 Request Timeout", b"request head too slow\n")
_BUSY = _response("503 Service Unavailable", b"busy\n")
_SOURCE_FULL = _response("503 Service Unavailable", b"too many connections from this address\n")


def source_of(peer: Any) -> str:
    """The source a peer address counts against: its IP, or its /64 for IPv6."""
    if not peer:
        return ""
    host = str(peer[0]) if isinstance(peer, tuple) else str(peer)
    try:
        addr = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return host
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, IPV6_SOURCE_PREFIX), strict=False))
    return str(addr)


class OpsListener:
    """Serves /metrics, /healthz and /readyz on its own address."""

    def __init__(self, registry: CollectorRegistry, ready: Check,
                 alive: Check | None = None, *, limits: OpsLimits | None = None) -> None:
        self._registry = registry
        self._ready = ready
        self._alive = alive
        self.limits = limits or OpsLimits()
        self._server: asyncio.Server | None = None
        self._live: set[_Connection] = set()  # every connection not yet lost, refused ones too
        self._admitted: set[_Connection] = set()  # the ones counted against the limits
        self._per_source: dict[str, int] = {}
        # Admitted connections still reading their head, by source, oldest first.
        self._reading: dict[str, dict[_Connection, None]] = {}
        self._stopping = False
        self._all_lost: asyncio.Event | None = None
        self.host = ""
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (port 0: any free port); returns the port. Raises OSError."""
        self._stopping = False
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Connection(self), host, port, reuse_address=True, backlog=LISTEN_BACKLOG)
        self.host = host
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        self._stopping = True
        if self._server is not None:
            self._server.close()
        self._all_lost = asyncio.Event()
        for conn in list(self._live):
            conn.close_now()
        if self._live:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_lost.wait(), STOP_GRACE_S)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    # -- bookkeeping, called by the connections ------------------------------------------

    def _admit(self, conn: _Connection) -> bytes | None:
        """Count a new connection in; or the answer that refuses it."""
        self._live.add(conn)
        if self._stopping:
            return _BUSY
        if self._per_source.get(conn.source, 0) >= self.limits.max_per_source:
            log.debug("ops listener: refused %s, its per-source limit is reached", conn.source)
            return _SOURCE_FULL
        if len(self._admitted) >= self.limits.max_connections:
            victim = eviction_victim(self._reading)
            if victim is None:
                return _BUSY
            log.debug("ops listener: full; closed a head-reading connection from %s",
                      victim.source)
            victim.end(_BUSY)
            self._release(victim)  # its answer is a few bytes: its slot is free at once
        self._admitted.add(conn)
        self._per_source[conn.source] = self._per_source.get(conn.source, 0) + 1
        self._reading.setdefault(conn.source, {})[conn] = None
        return None

    def _head_done(self, conn: _Connection) -> None:
        reading = self._reading.get(conn.source)
        if reading is not None and conn in reading:
            del reading[conn]
            if not reading:
                del self._reading[conn.source]

    def _release(self, conn: _Connection) -> None:
        """Stop counting a connection (it is gone, or evicted); safe to call twice."""
        if conn not in self._admitted:
            return
        self._admitted.discard(conn)
        self._head_done(conn)
        left = self._per_source[conn.source] - 1
        if left:
            self._per_source[conn.source] = left
        else:
            del self._per_source[conn.source]

    def _lost(self, conn: _Connection) -> None:
        self._release(conn)
        self._live.discard(conn)
        if not self._live and self._all_lost is not None:
            self._all_lost.set()

    # -- answers ------------------------------------------------------------------------

    def _answer(self, head: bytes) -> bytes:
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return _BAD_REQUEST
        method, target = parts[0], parts[1].partition(b"?")[0]
        if method not in (b"GET", b"HEAD"):
            return _response("405 Method Not Allowed", b"GET or HEAD\n")
        head_only = method == b"HEAD"
        if target == b"/metrics":
            return _response("200 OK", generate_latest(self._registry), CONTENT_TYPE_LATEST,
                             head_only)
        if target == b"/healthz":
            ok, why = (True, "") if self._alive is None else _holds(self._alive)
            return _status(ok, b"ok" if ok else b"not alive", why, head_only)
        if target == b"/readyz":
            ok, why = _holds(self._ready)
            return _status(ok, b"ready" if ok else b"not ready", why, head_only)
        return _response("404 Not Found", b"this port serves /metrics, /healthz, /readyz\n",
                         head_only=head_only)


def eviction_victim(reading: dict[str, dict[_Connection, None]]) -> _Connection | None:
    """The connection a full listener closes for a new one: the oldest still reading its
    head, from the source with the most such connections (so a lone prober is the last)."""
    if not reading:
        return None
    crowded = max(reading.values(), key=lambda conns: (len(conns), -next(iter(conns)).opened_at))
    return next(iter(crowded))


class _Connection(asyncio.Protocol):
    """One client connection: reads one request head under the deadlines, answers, closes."""

    def __init__(self, listener: OpsListener) -> None:
        self._listener = listener
        self._limits = listener.limits
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._timer: asyncio.TimerHandle | None = None
        self.reading_head = False
        self.source = ""
        self.opened_at = self._last_byte_at = self._loop.time()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it
        self.source = source_of(transport.get_extra_info("peername"))
        refusal = self._listener._admit(self)
        if refusal is not None:
            self.end(refusal)
            return
        self.reading_head = True
        first_due = min(self._limits.head_timeout_s, self._limits.idle_timeout_s)
        self._timer = self._loop.call_at(self.opened_at + first_due, self._check_deadline)

    def data_received(self, data: bytes) -> None:
        if not self.reading_head:
            return  # anything after the head is not read: one request per connection
        self._last_byte_at = self._loop.time()
        start = max(0, len(self._buf) - 3)
        self._buf += data
        end = self._buf.find(b"\r\n\r\n", start)
        if end < 0:
            if len(self._buf) > self._limits.max_head_bytes:
                self.end(_BAD_REQUEST)
            return
        if end + 4 > self._limits.max_head_bytes:
            self.end(_BAD_REQUEST)
            return
        self.end(  # a complete head is always answered, at once
            self._listener._answer(bytes(self._buf[:end + 4])))

    def eof_received(self) -> bool | None:
        if self.reading_head:
            self.end(_BAD_REQUEST)  # the client stopped sending before its head was complete
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._listener._lost(self)

    def end(self, answer: bytes) -> None:
        """Send `answer` and close; a client that does not take it in time is reset.
        The connection counts against the limits until it is gone."""
        self.reading_head = False
        self._listener._head_done(self)
        if self._timer is not None:
            self._timer.cancel()
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        transport.write(answer)
        transport.close()
        if transport.get_write_buffer_size():
            self._timer = self._loop.call_later(self._limits.send_timeout_s, transport.abort)

    def close_now(self) -> None:
        """At stop: a connection still reading gets a plain close, one still sending a reset."""
        self.reading_head = False
        if self._timer is not None:
            self._timer.cancel()
        if self._transport is not None:
            if self._transport.is_closing():
                self._transport.abort()
            else:
                self._transport.close()

    def _check_deadline(self) -> None:
        if not self.reading_head:
            return
        due = min(self.opened_at + self._limits.head_timeout_s,
                  self._last_byte_at + self._limits.idle_timeout_s)
        if self._loop.time() >= due:
            self.end(_TOO_SLOW)
        else:
            self._timer = self._loop.call_at(due, self._check_deadline)


def _status(ok: bool, word: bytes, why: str, head_only: bool) -> bytes:
    body = word + (b": " + why.encode(errors="replace") if why else b"") + b"\n"
    return _response("200 OK" if ok else "503 Service Unavailable", body, head_only=head_only)


def _holds(check: Check) -> tuple[bool, str]:
    """A callback's answer; one that raises means no."""
    try:
        answer = check()
    except Exception:
        log.exception("ops listener: a health callback failed")
        return False, "check failed"
    if isinstance(answer, tuple):
        return bool(answer[0]), str(answer[1]).replace("\n", " ")[:200]
    return bool(answer), ""
