"""The supervisor's health probe against real servers on loopback: what it reads of an
answer, when it reuses its connection, and how it fails."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from gearshift.agents.runtimes.health_probe import HealthProbe, ProbeFailed

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[tuple[int, list[int]]]:
    """A TCP server answering with `handler`; yields its port and a list that gets one
    entry per accepted connection."""
    accepted: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], accepted
    finally:
        server.close()
        await server.wait_closed()


async def answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      answer: bytes, times: int = 1000) -> None:
    for _ in range(times):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_statuses_of_an_aiohttp_server_on_one_kept_connection() -> None:
    status = {"code": 200}
    connections: set[object] = set()

    async def health(request: web.Request) -> web.Response:
        connections.add(request.transport)
        return web.Response(status=status["code"], text="" if status["code"] == 200 else "dead")

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    probe = HealthProbe(f"http://127.0.0.1:{port}/health", timeout_s=2.0)
    try:
        assert [await probe.status() for _ in range(5)] == [200] * 5
        status["code"] = 503
        assert await probe.status() == 503
        status["code"] = 200
        assert await probe.status() == 200
        assert len(connections) == 1
    finally:
        probe.close()
        await runner.cleanup()


async def test_refused_connection_reads_as_none() -> None:
    probe = HealthProbe(f"http://127.0.0.1:{closed_port()}/health", timeout_s=2.0)
    assert await probe.status() is None


async def test_a_kept_connection_the_engine_closed_is_replaced() -> None:
    async def one_answer_then_close(reader: asyncio.StreamReader,
                                    writer: asyncio.StreamWriter) -> None:
        await answer_each(reader, writer, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
                          times=1)

    async with raw_server(one_answer_then_close) as (port, accepted):
        probe = HealthProbe(f"http://127.0.0.1:{port}/health", timeout_s=2.0)
        assert [await probe.status() for _ in range(3)] == [200, 200, 200]
        assert len(accepted) == 3
        probe.close()


async def test_a_kept_connection_closed_while_the_request_is_sent_is_retried_once() -> None:
    """The engine's keep-alive timeout can close the connection as the probe writes: the
    close has not reached the probe yet, so it is sent once more on a new connection."""
    connections = 0

    async def first_keeps_quiet(reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        if connections == 1:
            await answer_each(reader, writer, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
                              times=1)
            await reader.readuntil(b"\r\n\r\n")  # the second request: closed unanswered
            return
        await answer_each(reader, writer, b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")

    async with raw_server(first_keeps_quiet) as (port, accepted):
        probe = HealthProbe(f"http://127.0.0.1:{port}/health", timeout_s=2.0)
        assert await probe.status() == 200
        assert await probe.status() == 204
        assert len(accepted) == 2
        probe.close()


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 4\r\n\r\ndead",
    b"HTTP/1.0 200 OK\r\n\r\nok",
])
async def test_an_answer_not_framed_by_its_length_gives_its_status_on_a_new_connection_each(
        answer: bytes) -> None:
    async with raw_server(lambda r, w: answer_each(r, w, answer)) as (port, accepted):
        probe = HealthProbe(f"http://127.0.0.1:{port}/health", timeout_s=2.0)
        expected = int(answer.split(b" ")[1])
        assert [await probe.status() for _ in range(3)] == [expected] * 3
        assert len(accepted) == 3
        probe.close()


async def test_a_body_in_pieces_is_read_to_its_length_before_the_next_probe() -> None:
    async def slow_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n{\"a\"")
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b":1}")
            await writer.drain()

    async with raw_server(slow_body) as (port, accepted):
        probe = HealthProbe(f"http://127.0.0.1:{port}/health", timeout_s=2.0)
        assert [await probe.status() for _ in range(3)] == [200] * 3
        assert len(accepted) == 1
        probe.close()


async def test_no_answer_times_out_within_the_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(10)

    async with raw_server(silent) as (port, _):
        probe = HealthProbe(f"http://127.0.0.1:{port}/health", timeout_s=0.2)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await probe.status()
        assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("answer", [b"SSH-2.0-OpenSSH\r\n\r\n", b"HTTP/1.1 abc\r\n\r\n", b""])
async def test_a_broken_or_missing_answer_is_a_failure(answer: bytes) -> None:
    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()

    async with raw_server(broken) as (port, _):
        probe = HealthProbe(f"http://127.0.0.1:{port}/health", timeout_s=2.0)
        with pytest.raises(ProbeFailed):
            await probe.status()


def test_only_plain_http_urls_are_taken() -> None:
    with pytest.raises(ValueError, match="http://HOST:PORT/PATH"):
        HealthProbe("https://127.0.0.1:8000/health", timeout_s=1.0)
    with pytest.raises(ValueError, match="timeout_s"):
        HealthProbe("http://127.0.0.1:8000/health", timeout_s=0)
