"""The gateway's HTTP/1.1 listener over raw loopback sockets: keep-alive, pipelining,
100-continue, chunked request bodies, HTTP/1.0, bad requests, small pages."""

from __future__ import annotations

import asyncio
import json

import pytest

pytestmark = pytest.mark.timeout(30)

BODY = json.dumps({"model": "llama", "prompt": "hi"}).encode()


def post(body: bytes = BODY, version: bytes = b"HTTP/1.1", extra: bytes = b"") -> bytes:
    return (b"POST /v1/completions " + version + b"\r\nHost: gw\r\nContent-Type: application/json"
            b"\r\n" + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response: status, headers (lower-case names), body (Content-Length, chunked or EOF)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.partition(":") for line in lines[1:] if line)}
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                return status, headers, body
            body += data[:-2]
    return status, headers, await reader.read()


@pytest.fixture
async def llama(upstreams, gateways):  # type: ignore[no-untyped-def]
    a = await upstreams("a")
    gw = await gateways({"llama": [{"endpoint": a.url}]})
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    yield a, gw, reader, writer
    writer.close()


async def test_keep_alive_and_pipelined_requests_share_one_connection(llama) -> None:  # type: ignore[no-untyped-def]
    a, _gw, reader, writer = llama
    writer.write(post())
    status, headers, body = await read_response(reader)
    assert status == 200 and json.loads(body)["served_by"] == "a"
    assert "close" not in headers.get("connection", "")
    writer.write(post() + post(json.dumps({"model": "llama", "n": 2}).encode()) + post())
    answers = [await read_response(reader) for _ in range(3)]
    assert [s for s, _, _ in answers] == [200, 200, 200]
    assert a.hits == 4


async def test_expect_100_continue_and_chunked_request_body(llama) -> None:  # type: ignore[no-untyped-def]
    _a, _gw, reader, writer = llama
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nExpect: 100-continue\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"5\r\n" + BODY[:5] + b"\r\n")
    await asyncio.sleep(0.05)
    rest = BODY[5:]
    writer.write(b"%x;ext=1\r\n%s\r\n0\r\n\r\n" % (len(rest), rest))
    status, _headers, body = await read_response(reader)
    assert status == 200
    assert json.loads(body) == {"served_by": "a", "model": "llama",
                                "path": "/v1/chat/completions", "auth": None}


async def test_http10_client_gets_its_answer_and_the_connection_closes(llama) -> None:  # type: ignore[no-untyped-def]
    _a, _gw, reader, writer = llama
    writer.write(post(version=b"HTTP/1.0"))
    status, headers, body = await read_response(reader)
    assert status == 200 and headers["connection"] == "close"
    assert json.loads(body)["served_by"] == "a"
    assert await reader.read() == b""


async def test_http10_stream_is_delimited_by_close(llama) -> None:  # type: ignore[no-untyped-def]
    a, _gw, reader, writer = llama
    a.release.set()
    writer.write(post(json.dumps({"model": "llama", "stream": True}).encode(), b"HTTP/1.0"))
    status, headers, body = await read_response(reader)
    assert status == 200 and "transfer-encoding" not in headers
    assert body.startswith(b"data: ") and body.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize(("wire", "status", "needle"), [
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", 400,
     "conflicting"),
    (b"BREW /pot HTTP/1.1\r\nBad Header\r\n\r\n", 400, "malformed header line"),
    (b"GET / HTTP/3\r\n\r\n", 505, "HTTP/3"),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 999999999999\r\n\r\n", 413, "limit"),
    (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 431, "larger than"),
    (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nxyz\r\n", 400,
     "chunk-size"),
])
async def test_unreadable_requests_get_a_clear_error_and_a_close(llama, wire: bytes, status: int,  # type: ignore[no-untyped-def]
                                                                 needle: str) -> None:
    a, _gw, reader, writer = llama
    writer.write(wire)
    got, headers, body = await read_response(reader)
    assert got == status and headers["connection"] == "close"
    assert needle in json.loads(body)["error"]["message"]
    assert await reader.read() == b""
    assert a.hits == 0


async def test_small_pages_unknown_paths_and_methods(llama) -> None:  # type: ignore[no-untyped-def]
    _a, _gw, reader, writer = llama
    writer.write(b"HEAD /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"Content-Length: " in head
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n")
    status, _h, body = await read_response(reader)
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["llama"]
    writer.write(b"GET /v1/completions HTTP/1.1\r\nHost: gw\r\n\r\n")
    status, _h, body = await read_response(reader)
    assert status == 405 and "POST" in json.loads(body)["error"]["message"]
    writer.write(b"POST /v1/models HTTP/1.1\r\nHost: gw\r\nContent-Length: 0\r\n\r\n")
    status, _h, _b = await read_response(reader)
    assert status == 405
    writer.write(b"GET /nope HTTP/1.1\r\nHost: gw\r\n\r\n")
    status, _h, body = await read_response(reader)
    assert status == 404 and "/v1/completions" in json.loads(body)["error"]["message"]


async def test_stop_lets_a_stream_in_flight_finish(upstreams, gateways) -> None:  # type: ignore[no-untyped-def]
    a = await upstreams("a")
    gw = await gateways({"llama": [{"endpoint": a.url}]})
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(post(json.dumps({"model": "llama", "stream": True}).encode()))
    await reader.readuntil(b"\r\n\r\n")
    stopping = asyncio.create_task(gw.stop())
    await asyncio.sleep(0.1)
    assert not stopping.done()  # waits for the stream
    with pytest.raises(OSError):  # but accepts no new connections
        await asyncio.open_connection("127.0.0.1", gw.port)
    a.release.set()
    rest = await reader.read()
    assert rest.endswith(b"0\r\n\r\n") and b"[DONE]" in rest
    await stopping
    writer.close()
