"""Hostile clients on raw loopback sockets: smuggling bytes in heads, framing tricks,
too many connections, too many bodies, slow heads and bodies, deep or huge JSON, probing
for the gateway's insides. Every refusal is a clean answer and a closed connection, the
upstream never sees the request, and the limits are small so each test ends in seconds."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gearshift.gateway.limits import ClientLimits

pytestmark = pytest.mark.timeout(30)

BODY = json.dumps({"model": "llama", "prompt": "hi"}).encode()
ANSWER_WITHIN_S = 5.0  # every answer below comes much sooner; this bounds a hang


def post(extra: bytes = b"", body: bytes = BODY) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n" + extra
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


async def answer(reader: asyncio.StreamReader) -> tuple[int, bytes, bytes]:
    """(status, head, body) of one Content-Length response."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_WITHIN_S)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    body = await asyncio.wait_for(reader.readexactly(length), ANSWER_WITHIN_S)
    return int(head.split(b" ")[1]), head, body


async def refused(port: int, wire: bytes) -> tuple[int, bytes]:
    """Send `wire`; the answer's status and body, after checking the connection closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(wire)
        status, head, body = await answer(reader)
        assert b"Connection: close" in head
        assert await asyncio.wait_for(reader.read(), ANSWER_WITHIN_S) == b""
        return status, body
    finally:
        writer.close()


async def scrape(http, gw) -> dict[str, float]:  # type: ignore[no-untyped-def]
    async with http.get(f"{gw.metrics_url}/metrics") as r:
        text = await r.text()
    return {s.name + "".join(f"|{v}" for v in s.labels.values()): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture
async def llama(upstreams, gateways):  # type: ignore[no-untyped-def]
    async def make(**limits: float):  # type: ignore[no-untyped-def]
        a = await upstreams("a")
        gw = await gateways({"llama": [{"endpoint": a.url}]},
                            client_limits=ClientLimits(**limits))  # type: ignore[arg-type]
        return a, gw
    return make


# -- strict bytes ------------------------------------------------------------------------

@pytest.mark.parametrize(("extra", "needle"), [
    # a bare LF would let a lenient upstream read a second header (and another framing)
    (b"X-A: a\nTransfer-Encoding: chunked\r\n", b"0x0a"),
    (b"X-A: a\rTransfer-Encoding: chunked\r\n", b"0x0d"),
    (b"X-A: a\x00b\r\n", b"0x00"),
    (b"X-A: a\x1bb\r\n", b"0x1b"),
    (b"X-A: a\r\n b\r\n", b"obs-fold"),
    (b"X\x00A: a\r\n", b"0x00"),
    (b"Transfer-Encoding: gzip, chunked\r\n", b"single"),
    (b"Transfer-Encoding: chunked, chunked\r\n", b"single"),
    (b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n", b"single"),
])
async def test_control_bytes_and_inexact_framing_in_heads_are_400(llama, extra: bytes,  # type: ignore[no-untyped-def]
                                                                  needle: bytes) -> None:
    a, gw = await llama()
    wire = post(extra) if b"Transfer-Encoding" not in extra else (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n" + extra + b"\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY))
    status, message = await refused(gw.port, wire)
    assert status == 400 and needle in message
    assert a.hits == 0


@pytest.mark.parametrize("chunks", [
    b"%x\n%s\r\n0\r\n\r\n",  # a bare LF ends the size line
    b"%x;a\nb\r\n%s\r\n0\r\n\r\n",  # a bare LF in an extension
    b" %x\r\n%s\r\n0\r\n\r\n",  # leading whitespace
    b"%x;\r\n%s\r\n0\r\n\r\n",  # an extension without a name
])
async def test_loose_chunk_size_lines_are_400(llama, chunks: bytes) -> None:  # type: ignore[no-untyped-def]
    a, gw = await llama()
    wire = (b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n"
            + chunks % (len(BODY), BODY))
    status, message = await refused(gw.port, wire)
    assert status == 400 and b"chunk" in message
    assert a.hits == 0


# -- bounded resources ---------------------------------------------------------------------

async def test_connections_past_the_cap_get_503_and_the_cap_frees(llama, http) -> None:  # type: ignore[no-untyped-def]
    _a, gw = await llama(max_connections=3)
    held = [await asyncio.open_connection("127.0.0.1", gw.port) for _ in range(3)]
    try:
        await asyncio.sleep(0.05)  # the three are accepted
        status, message = await refused(gw.port, post())
        assert status == 503 and b"3 client connections" in message
        reader, writer = held[0]
        writer.write(post())  # the held ones are served
        status, _h, _b = await answer(reader)
        assert status == 200
        held.pop()[1].close()
        await asyncio.sleep(0.05)
        status, _m = await refused(gw.port, post(b"Connection: close\r\n"))
        assert status == 200
    finally:
        for _r, w in held:
            w.close()
    metrics = await scrape(http, gw)
    assert metrics["gearshift_gateway_client_refusals_total|connection_limit"] == 1
    assert metrics["gearshift_gateway_client_connections_limit"] == 3


async def test_bodies_past_the_shared_budget_get_503_until_it_frees(llama, http) -> None:  # type: ignore[no-untyped-def]
    a, gw = await llama(body_budget_bytes=1000, max_body_bytes=800)
    body = json.dumps({"model": "llama", "pad": "x" * 700}).encode()
    first_r, first_w = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        whole = post(body=body)
        first_w.write(whole[:-10])  # the head and most of the body: its 7xx bytes are reserved
        await asyncio.sleep(0.05)
        assert (await scrape(http, gw))["gearshift_gateway_request_body_bytes"] == len(body)
        status, message = await refused(gw.port, post(body=body))
        assert status == 503 and b"retry" in message
        first_w.write(whole[-10:])
        status, _h, _b = await answer(first_r)
        assert status == 200
    finally:
        first_w.close()
    status, _m = await refused(gw.port, post(b"Connection: close\r\n", body=body))
    assert status == 200 and a.hits == 2
    metrics = await scrape(http, gw)
    assert metrics["gearshift_gateway_client_refusals_total|body_budget"] == 1
    assert metrics["gearshift_gateway_request_body_bytes"] == 0
    assert metrics["gearshift_gateway_request_body_budget_bytes"] == 1000


async def test_unfinished_heads_count_against_the_shared_budget(llama, http) -> None:  # type: ignore[no-untyped-def]
    _a, gw = await llama(body_budget_bytes=64 * 1024, max_body_bytes=32 * 1024)
    start = b"POST /v1/completions HTTP/1.1" + b"".join(
        b"\r\nX-Pad-%d: %s" % (i, b"p" * 1000) for i in range(39))
    partial = start + b"\r\nX-End: " + b"e" * (40 * 1024 - len(start) - 9)  # 40 KiB, no end
    held = []
    try:
        for _ in range(2):  # 32 KiB each past the 8 KiB allowance: the budget is full
            held.append(await asyncio.open_connection("127.0.0.1", gw.port))
            held[-1][1].write(partial)
        await asyncio.sleep(0.1)
        assert (await scrape(http, gw))["gearshift_gateway_request_body_bytes"] == 64 * 1024
        status, body = await refused(gw.port, partial)
        assert status == 503 and b"retry" in body
        held.pop()[1].close()
        await asyncio.sleep(0.1)
        assert (await scrape(http, gw))["gearshift_gateway_request_body_bytes"] == 32 * 1024
        reader, writer = held[0]
        writer.write(b"\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
        status, _h, _b = await answer(reader)  # the finished head is served
        assert status == 200
        assert (await scrape(http, gw))["gearshift_gateway_request_body_bytes"] == 0
    finally:
        for _r, w in held:
            w.close()


async def test_a_trickled_head_is_cut_at_the_head_deadline(llama, http) -> None:  # type: ignore[no-untyped-def]
    _a, gw = await llama(head_timeout_s=0.4, idle_timeout_s=0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        got = b""
        for byte in post()[:-len(BODY) - 4]:  # one byte every 50 ms: each one "activity"
            writer.write(bytes([byte]))
            try:
                got = await asyncio.wait_for(reader.read(), 0.05)
            except TimeoutError:
                continue
            break
        assert got.startswith(b"HTTP/1.1 408 ") and b"request head" in got
        assert loop.time() - t0 < 2.0
    finally:
        writer.close()
    assert (await scrape(http, gw))["gearshift_gateway_client_refusals_total|timeout"] == 1


async def test_a_body_slower_than_the_minimum_rate_is_cut(llama) -> None:  # type: ignore[no-untyped-def]
    a, gw = await llama(body_grace_s=0.3, body_min_rate_bps=1000)
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(post(body=b"x" * 100_000)[:-100_000])
        got = b""
        for _ in range(60):  # one byte every 50 ms: 20 bytes/s
            writer.write(b"x")
            try:
                got = await asyncio.wait_for(reader.read(), 0.05)
            except TimeoutError:
                continue
            break
        assert got.startswith(b"HTTP/1.1 408 ") and b"slower than" in got
    finally:
        writer.close()
    assert a.hits == 0


async def test_an_idle_connection_is_closed_and_a_quick_one_is_served(llama) -> None:  # type: ignore[no-untyped-def]
    _a, gw = await llama(idle_timeout_s=0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(post())
        status, _h, _b = await answer(reader)
        assert status == 200
        assert await asyncio.wait_for(reader.read(), ANSWER_WITHIN_S) == b""  # idle: closed
    finally:
        writer.close()


# -- no traceback paths, no echo, nothing private ------------------------------------------

@pytest.mark.parametrize("body", [
    b"[" * 100_000 + b"]" * 100_000,  # past the parser's own recursion limit
    # 70 levels: within the parser's limit, past the gateway's (64)
    b'{"model": "llama", "x": ' + b"[" * 69 + b"1" + b"]" * 69 + b"}",
], ids=["100k-deep", "70-deep"])
async def test_deeply_nested_json_is_400_without_a_traceback(llama, caplog, body: bytes) -> None:  # type: ignore[no-untyped-def]
    a, gw = await llama()
    caplog.set_level(logging.WARNING)
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(post(body=body))
        status, _h, raw = await answer(reader)
    finally:
        writer.close()
    assert status == 400 and json.loads(raw)["error"]["code"] == "json_too_deep"
    assert a.hits == 0 and not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_error_bodies_do_not_echo_large_input_or_list_models(llama) -> None:  # type: ignore[no-untyped-def]
    _a, gw = await llama()
    huge = "m" * 10_000_000
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(post(body=json.dumps({"model": huge}).encode()))
        status, _h, raw = await answer(reader)
        assert status == 404 and len(raw) < 1000
        message = json.loads(raw)["error"]["message"]
        assert "llama" not in message and "/v1/models" in message
        writer.write(b"GET /" + b"p" * 30_000 + b" HTTP/1.1\r\nHost: gw\r\n\r\n")
        status, _h, raw = await answer(reader)
        assert status == 404 and len(raw) < 1000
    finally:
        writer.close()


@pytest.mark.parametrize("path", [b"/metrics", b"/health", b"/healthz", b"/readyz"])
async def test_the_api_port_serves_no_metrics_or_operator_probes(llama, path: bytes) -> None:  # type: ignore[no-untyped-def]
    _a, gw = await llama()
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: gw\r\n\r\n")
        status, _h, raw = await answer(reader)
    finally:
        writer.close()
    if path == b"/health":  # vLLM's probe, the one on the API port: a status, no body
        assert (status, raw) == (200, b"")
    else:
        assert status == 404 and b"gearshift_gateway" not in raw and b"routes" not in raw


async def test_the_metrics_listener_refuses_junk_and_says_nothing_private(llama, http) -> None:  # type: ignore[no-untyped-def]
    _a, gw = await llama()
    port = int(gw.metrics_url.rsplit(":", 1)[1])
    for wire in (b"\x00\x01junk\r\n\r\n", b"GET /readyz HTTP/1.1\r\n" + b"X: y\r\n" * 2000):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(wire)
            got = await asyncio.wait_for(reader.read(), ANSWER_WITHIN_S)
        finally:
            writer.close()
        assert got.startswith(b"HTTP/1.1 400 ")
    async with http.get(f"{gw.metrics_url}/readyz") as r:
        assert r.status == 200 and await r.text() == "ready\n"
    async with http.post(f"{gw.metrics_url}/metrics") as r:
        assert r.status == 405
