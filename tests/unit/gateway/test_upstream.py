"""Upstream connections against hand-written loopback engines: keep-alive reuse, a kept-alive
connection the engine dropped, framing (chunked, until close), timeouts, the connection limit;
and the same framings relayed through a whole gateway."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from gearshift.gateway.http11 import ChunkedDecoder
from gearshift.gateway.routes import Endpoint, RoutingTable
from gearshift.gateway.upstream import UpstreamConnectError, UpstreamError, UpstreamTimeout
from gearshift.gateway.upstream_pool import UpstreamPool

pytestmark = pytest.mark.timeout(30)

OK_BODY = b'{"ok":true}'
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n" + OK_BODY
REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: e\r\nContent-Length: 2\r\n\r\n{}"


def pool(**overrides: float) -> UpstreamPool:
    settings = {"limit": 8, "connect_timeout_s": 2.0, "read_timeout_s": 5.0,
                "idle_timeout_s": 5.0, **overrides}
    return UpstreamPool(**settings)  # type: ignore[arg-type]


async def test_kept_alive_connection_is_reused_and_idle_ones_expire(engine) -> None:  # type: ignore[no-untyped-def]
    async def keep_alive(_n: int, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await e.read_request(r)
            w.write(OK)

    e = await engine(keep_alive)
    p = pool(idle_timeout_s=0.2)
    for _ in range(5):
        conn = await p.request(("127.0.0.1", e.port, False), REQUEST)
        assert conn.head is not None and conn.head.status == 200
        assert await conn.read() == OK_BODY
        p.release(conn)
    assert (e.connections, e.requests) == (1, 5)
    await asyncio.sleep(0.6)  # idle past the timeout: the gateway closes it
    assert e.closed == 1
    p.close()


async def test_a_dropped_kept_alive_connection_is_retried_on_a_new_one(engine) -> None:  # type: ignore[no-untyped-def]
    async def drop_second(n: int, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await e.read_request(r)
        w.write(OK)
        if n == 1:
            await e.read_request(r)  # the keep-alive timeout races this request: no answer
            return
        while True:
            await e.read_request(r)
            w.write(OK)

    e = await engine(drop_second)
    p = pool()
    key = ("127.0.0.1", e.port, False)
    first = await p.request(key, REQUEST)
    assert await first.read() == OK_BODY
    p.release(first)
    conn = await p.request(key, REQUEST)  # on the kept-alive connection, which the engine drops
    assert await conn.read() == OK_BODY and e.connections == 2
    p.close()


async def test_no_retry_once_the_engine_answered_something(engine) -> None:  # type: ignore[no-untyped-def]
    async def half_head(_n: int, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await e.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Le")

    e = await engine(half_head)
    with pytest.raises(UpstreamError, match="before the response head"):
        await pool().request(("127.0.0.1", e.port, False), REQUEST)
    assert e.requests == 1


async def test_framings_chunked_until_close_and_garbage(engine) -> None:  # type: ignore[no-untyped-def]
    async def script(n: int, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await e.read_request(r)
        if n == 1:
            w.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked"
                    b"\r\n\r\n3\r\nabc\r\n")
            await asyncio.sleep(0.05)
            w.write(b"2\r\nde\r\n0\r\n\r\n")
        elif n == 2:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil ")
            await asyncio.sleep(0.05)
            w.write(b"close")
        else:
            w.write(b"SPDY/3 200 OK\r\n\r\n")

    e = await engine(script)
    p = pool()
    key = ("127.0.0.1", e.port, False)
    chunked = await p.request(key, REQUEST)
    assert await chunked.readany() == b"abc"
    assert await chunked.readany() == b"de" and await chunked.readany() == b""
    assert chunked.reusable
    p.close()
    until_close = await p.request(key, REQUEST)
    assert await until_close.read() == b"until close" and not until_close.reusable
    with pytest.raises(UpstreamError, match="malformed upstream status line"):
        await p.request(key, REQUEST)
    p.close()


async def test_timeouts_and_refused_connections(engine) -> None:  # type: ignore[no-untyped-def]
    async def silent(_n: int, r: asyncio.StreamReader, _w: asyncio.StreamWriter) -> None:
        await e.read_request(r)
        await asyncio.sleep(10)

    e = await engine(silent)
    p = pool(read_timeout_s=0.1, idle_timeout_s=0.1)
    with pytest.raises(UpstreamTimeout, match="no complete response head"):
        await p.request(("127.0.0.1", e.port, False), REQUEST)
    await e.stop()
    await asyncio.sleep(0.05)
    with pytest.raises(UpstreamConnectError, match="cannot connect"):
        await p.request(("127.0.0.1", e.port, False), REQUEST)
    assert e.requests == 1


async def test_connection_limit_makes_requests_wait(engine) -> None:  # type: ignore[no-untyped-def]
    async def slow(_n: int, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await e.read_request(r)
            await asyncio.sleep(0.05)
            w.write(OK)

    e = await engine(slow)
    p = pool(limit=1)

    async def one() -> bytes:
        conn = await p.request(("127.0.0.1", e.port, False), REQUEST)
        try:
            return await conn.read()
        finally:
            p.release(conn)

    assert await asyncio.gather(one(), one(), one()) == [OK_BODY] * 3
    assert e.connections == 1
    p.close()


async def test_gateway_relays_chunked_and_until_close_answers_and_renames(engine, gateways,  # type: ignore[no-untyped-def]
                                                                          http) -> None:
    seen: list[dict[str, object]] = []

    async def script(n: int, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        request = await e.read_request(r)
        seen.append(json.loads(request.split(b"\r\n\r\n", 1)[1]))
        body = json.dumps({"model": seen[-1]["model"], "n": n}).encode()
        if n == 1:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        else:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + body)
        await w.drain()

    e = await engine(script)
    gw = await gateways({})
    gw.router.set_table(RoutingTable(models={"llama": (Endpoint(
        deployment_id="d", endpoint=f"http://127.0.0.1:{e.port}",
        served_model_name="/models/llama-8b"),)}))
    for n in (1, 2):
        async with http.post(f"{gw.url}/v1/completions",
                             json={"model": "llama", "prompt": "x"}) as resp:
            assert resp.status == 200
            assert await resp.json() == {"model": "llama", "n": n}
    assert [s["model"] for s in seen] == ["/models/llama-8b"] * 2
    assert seen[0]["prompt"] == "x"


async def test_a_client_that_does_not_read_holds_back_the_engine(engine, gateways) -> None:  # type: ignore[no-untyped-def]
    piece = b"data: " + b"x" * (256 * 1024 - 8) + b"\n\n"
    written = 0

    async def big(_n: int, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal written
        await e.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(256):  # 64 MiB
            w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await w.drain()
            written += len(piece)
        w.write(b"0\r\n\r\n")
        await w.drain()

    e = await engine(big)
    gw = await gateways({"llama": [{"endpoint": f"http://127.0.0.1:{e.port}"}]})
    loop = asyncio.get_running_loop()
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        client.setblocking(False)
        await loop.sock_connect(client, ("127.0.0.1", gw.port))
        body = b'{"model": "llama", "stream": true}'
        await loop.sock_sendall(client, b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n"
                                b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await asyncio.sleep(1.0)  # the client reads nothing meanwhile
        # socket buffers hold some MiB; the gateway must not read the rest into memory
        assert written < 24 * 2**20
        received = bytearray()
        while not received.endswith(b"0\r\n\r\n"):
            data = await loop.sock_recv(client, 1 << 20)
            assert data, "the stream ended early"
            received += data
    head, _, wire = bytes(received).partition(b"\r\n\r\n")
    decoder = ChunkedDecoder()
    pieces, _rest = decoder.feed(wire)
    assert head.startswith(b"HTTP/1.1 200") and decoder.done
    assert written == 256 * len(piece) and b"".join(pieces) == piece * 256


async def test_a_large_request_body_reaches_the_engine_intact(engine, gateways, http) -> None:  # type: ignore[no-untyped-def]
    seen: list[bytes] = []

    async def script(_n: int, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            seen.append((await e.read_request(r)).split(b"\r\n\r\n", 1)[1])
            w.write(OK)

    e = await engine(script)
    gw = await gateways({"llama": [{"endpoint": f"http://127.0.0.1:{e.port}"}]})
    for size in (100, 3 * 1024 * 1024):  # one write with the head; the body written apart
        body = json.dumps({"model": "llama", "prompt": "p" * size}).encode()
        async with http.post(f"{gw.url}/v1/completions", data=body) as resp:
            assert resp.status == 200 and await resp.read() == OK_BODY
        assert seen[-1] == body
