"""Broken and hostile engines behind a whole gateway: every failure gets the client a clean
answer in bounded time, nothing an engine sends reaches the client unchecked, and large
answers are relayed in pieces rather than read whole."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(30)

BODY_TIMEOUT_S = 0.3  # the gateway's longest wait for more of an answer's body, here
CLEAN_ANSWER_WITHIN_S = 3.0  # far below any default timeout (60 s body, 600 s head)


async def failing_engine(engine, answer: bytes, then: str = "hold"):  # type: ignore[no-untyped-def]
    """An engine that writes `answer` to every request, then holds the connection open
    ("hold") or closes it ("close")."""
    async def script(_n: int, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await e.read_request(r)
        w.write(answer)
        await w.drain()
        if then == "hold":
            await asyncio.sleep(20)

    e = await engine(script)
    return e


async def gateway_for(gateways, e):  # type: ignore[no-untyped-def]
    return await gateways({"llama": [{"endpoint": f"http://127.0.0.1:{e.port}"}]},
                          upstream_body_timeout_s=BODY_TIMEOUT_S)


async def ask(http, gw, stream: bool = False):  # type: ignore[no-untyped-def]
    """(status, headers, body) for one completion, within CLEAN_ANSWER_WITHIN_S."""
    async def go():  # type: ignore[no-untyped-def]
        async with http.post(f"{gw.url}/v1/completions",
                             json={"model": "llama", "stream": stream}) as r:
            return r.status, r.headers, await r.read()
    return await asyncio.wait_for(go(), CLEAN_ANSWER_WITHIN_S)


async def errors(http, gw, reason: str) -> float:  # type: ignore[no-untyped-def]
    async with http.get(f"{gw.metrics_url}/metrics") as r:
        text = await r.text()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "gearshift_gateway_errors_total" and s.labels["reason"] == reason)


@pytest.mark.parametrize("answer", [
    # a header value smuggling another header (and a cookie) to the client
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\nSet-Cookie: a=b\r\n"
    b"Content-Length: 2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-A: \x00\r\n"
    b"Content-Length: 2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\tfolded\r\n"
    b"Content-Length: 2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\n{}\r\n0\r\n\r\n",
    b"HTTP/1.1 099 Early\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
    b"HTTP/1.1 103 Early Hints\r\n\r\n" * 9,  # more interim answers than allowed
    b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"p" * 70_000 + b"\r\n\r\n",  # oversized head
    b"HTTP/1.1 2x0 OK\r\n\r\n",
])
async def test_a_malformed_answer_is_a_clean_502(engine, gateways, http,  # type: ignore[no-untyped-def]
                                                 answer: bytes) -> None:
    e = await failing_engine(engine, answer)
    gw = await gateway_for(gateways, e)
    status, headers, body = await ask(http, gw)
    assert status == 502 and "Set-Cookie" not in headers
    assert json.loads(body)["error"]["code"] == "upstream_unavailable"


async def test_a_valid_interim_answer_is_skipped(engine, gateways, http) -> None:  # type: ignore[no-untyped-def]
    e = await failing_engine(engine, b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\n"
                             b"Link: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Type: "
                             b"application/json\r\nContent-Length: 2\r\n\r\n{}")
    gw = await gateway_for(gateways, e)
    status, _h, body = await ask(http, gw)
    assert (status, body) == (200, b"{}")


async def test_a_short_body_on_a_held_connection_is_a_clean_502(engine, gateways, http) -> None:  # type: ignore[no-untyped-def]
    e = await failing_engine(engine, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100\r\n\r\n{\"partial\":")
    gw = await gateway_for(gateways, e)
    status, _h, body = await ask(http, gw)
    assert status == 502 and b"no body data" in body


async def test_a_short_body_then_close_is_a_clean_502(engine, gateways, http) -> None:  # type: ignore[no-untyped-def]
    e = await failing_engine(engine, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100\r\n\r\n{\"partial\":", then="close")
    gw = await gateway_for(gateways, e)
    status, _h, body = await ask(http, gw)
    assert status == 502 and b"mid-body" in body


async def test_a_stream_cut_mid_body_ends_without_its_last_chunk(engine, gateways, http) -> None:  # type: ignore[no-untyped-def]
    event = b'data: {"i": 0}\n\n'
    for then in ("hold", "close"):
        e = await failing_engine(engine, b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n"
                                 % (len(event), event), then=then)
        gw = await gateway_for(gateways, e)
        got = b""
        with pytest.raises(aiohttp.ClientPayloadError):
            async with http.post(f"{gw.url}/v1/completions",
                                 json={"model": "llama", "stream": True}) as r:
                assert r.status == 200
                async for piece in r.content.iter_any():
                    got += piece
        assert got == event
        assert await errors(http, gw, "truncated") == 1


async def test_a_large_body_is_relayed_before_it_is_all_in_and_cut_short_on_failure(  # type: ignore[no-untyped-def]
        engine, gateways, http) -> None:
    size = 8 * 1024 * 1024
    sent_first = asyncio.Event()
    go_on = asyncio.Event()

    async def script(_n: int, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await e.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % size + b"x" * (1024 * 1024))
        await w.drain()
        sent_first.set()
        await go_on.wait()
        w.write(b"y" * 1024)  # then the engine dies, 7 MiB short
        await w.drain()

    e = await engine(script)
    gw = await gateway_for(gateways, e)
    got = 0
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(f"{gw.url}/v1/completions", json={"model": "llama"}) as r:
            assert r.status == 200 and r.headers["Content-Length"] == str(size)
            while got < 1024 * 1024:  # the first MiB arrives while the engine holds the rest
                got += len(await asyncio.wait_for(r.content.readany(), CLEAN_ANSWER_WITHIN_S))
            go_on.set()
            async for piece in r.content.iter_any():
                got += len(piece)
    assert sent_first.is_set() and got == 1024 * 1024 + 1024
    assert await errors(http, gw, "truncated") == 1


async def test_a_large_or_endless_error_body_is_not_collected(engine, gateways, http) -> None:  # type: ignore[no-untyped-def]
    piece = b"e" * 65536
    e = await failing_engine(engine, b"HTTP/1.1 500 Internal Server Error\r\n"
                             b"Content-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
                             + b"%x\r\n%s\r\n" % (len(piece), piece) * 4)
    gw = await gateway_for(gateways, e)
    status, headers, body = await ask(http, gw)
    assert status == 500 and len(body) < 1000 and headers["Content-Type"] == "application/json"
    assert b"larger than" in body
