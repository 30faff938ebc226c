"""A small HTTP listener for operators: `/metrics`, `/healthz` (alive), `/readyz` (ready).

Kept apart from any client-facing port so that scrapes and probes never share a
listener, or a failure mode, with the traffic they watch. It knows nothing of the
process it serves: it is given a Prometheus registry and readiness (and,
optionally, liveness) callbacks, so any gearshift daemon can run one.

Deliberately plain: one request per connection (answered with `Connection:
close`), GET and HEAD only, a small head read under a deadline, a cap on open
connections, and bodies that say nothing beyond ready or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8 * 1024
HEAD_TIMEOUT_S = 5.0  # the whole request head must arrive within this
MAX_CONNECTIONS = 64
_TEXT = "text/plain; charset=utf-8"


def _response(status: str, body: bytes, content_type: str = _TEXT, head_only: bool = False,
              ) -> bytes:
    head = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\n"
            "Connection: close\r\n\r\n").encode()
    return head if head_only else head + body


class OpsListener:
    """Serves /metrics, /healthz and /readyz on its own address."""

    def __init__(self, registry: CollectorRegistry, ready: Callable[[], bool],
                 alive: Callable[[], bool] | None = None) -> None:
        self._registry = registry
        self._ready = ready
        self._alive = alive
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (port 0: any free port); returns the port. Raises OSError."""
        self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True,
                                                  limit=MAX_HEAD_BYTES)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._open):
            task.cancel()
        for task in list(self._open):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        try:
            if len(self._open) >= MAX_CONNECTIONS:
                writer.write(_response("503 Service Unavailable", b"busy\n"))
                return
            self._open.add(task)
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
                    ValueError):
                writer.write(_response("400 Bad Request", b"bad request\n"))
                return
            writer.write(self._answer(head))
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            self._open.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def _answer(self, head: bytes) -> bytes:
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return _response("400 Bad Request", b"bad request\n")
        method, target = parts[0], parts[1].partition(b"?")[0]
        if method not in (b"GET", b"HEAD"):
            return _response("405 Method Not Allowed", b"GET or HEAD\n")
        head_only = method == b"HEAD"
        if target == b"/metrics":
            return _response("200 OK", generate_latest(self._registry), CONTENT_TYPE_LATEST,
                             head_only)
        if target == b"/healthz":
            ok = self._alive is None or _holds(self._alive)
            return _response("200 OK" if ok else "503 Service Unavailable",
                             b"ok\n" if ok else b"not alive\n", head_only=head_only)
        if target == b"/readyz":
            ok = _holds(self._ready)
            return _response("200 OK" if ok else "503 Service Unavailable",
                             b"ready\n" if ok else b"not ready\n", head_only=head_only)
        return _response("404 Not Found", b"this port serves /metrics, /healthz, /readyz\n",
                         head_only=head_only)


def _holds(check: Callable[[], bool]) -> bool:
    """A readiness or liveness callback's answer; one that raises means no."""
    try:
        return bool(check())
    except Exception:
        log.exception("ops listener: a health callback failed")
        return False
