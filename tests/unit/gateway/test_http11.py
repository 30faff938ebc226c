"""HTTP/1.1 framing rules on bytes: request and response heads, chunked bodies."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gearshift.gateway.http11 import (
    ChunkedDecoder,
    HttpError,
    encode_chunk,
    parse_request_head,
    parse_response_head,
    status_line,
)


def test_request_head_fields_and_keep_alive() -> None:
    head = parse_request_head(b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: gw\r\n"
                              b"Content-Type: application/json\r\nContent-Length:  12 \r\n"
                              b"Authorization: Bearer k")
    assert (head.method, head.path, head.target) == (b"POST", "/v1/completions",
                                                     b"/v1/completions?x=1")
    assert head.content_length == 12 and not head.chunked and head.keep_alive
    assert (b"Authorization", b"Bearer k") in head.headers
    assert not parse_request_head(b"GET / HTTP/1.1\r\nConnection: close").keep_alive
    assert not parse_request_head(b"GET / HTTP/1.0").keep_alive
    assert parse_request_head(b"GET / HTTP/1.0\r\nConnection: Keep-Alive").keep_alive
    chunked = parse_request_head(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n"
                                 b"Expect: 100-continue")
    assert chunked.chunked and chunked.expect_continue and chunked.content_length == 0


@pytest.mark.parametrize(("head", "status", "needle"), [
    (b"POST /v1/completions", 400, "request line"),
    (b"POST v1 HTTP/1.1", 400, "must be a path"),
    (b"GET / HTTP/2.0", 505, "HTTP/2.0"),
    (b"GET / HTTP/1.1\r\nBad Name: x", 400, "malformed header line"),
    (b"GET / HTTP/1.1\r\n folded", 400, "obs-fold"),
    (b"GET / HTTP/1.1\r\nX-A: a\r\n b", 400, "obs-fold"),
    (b"GET / HTTP/1.1\r\nX-A: a\nTransfer-Encoding: chunked", 400, "0x0a"),
    (b"GET / HTTP/1.1\r\nX-A: a\rTransfer-Encoding: chunked", 400, "0x0d"),
    (b"GET / HTTP/1.1\r\nX-A: a\x00b", 400, "0x00"),
    (b"GET / HTTP/1.1\r\nX-A: a\x7fb", 400, "0x7f"),
    (b"GET / HTTP/1.1\r\nX-A\x01: a", 400, "0x01"),
    (b"GET /a\x80b HTTP/1.1", 400, "must be a path"),
    (b"GET / HTTP/1.1\nHost: x", 400, "0x0a"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked, chunked", 400, "single"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked", 400, "single"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked", 400,
     "single"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: \"chunked\"", 400, "single"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked;q=1", 400, "single"),
    (b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked", 400, "HTTP/1.0"),
    (b"POST / HTTP/1.1\r\nContent-Length: -1", 400, "Content-Length"),
    (b"POST / HTTP/1.1\r\nContent-Length: 0x10", 400, "Content-Length"),
    (b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2", 400, "conflicting"),
    (b"POST / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked", 400, "both"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip", 501, "gzip"),
    (b"POST / HTTP/1.1\r\nExpect: magic", 417, "magic"),
])
def test_bad_request_heads_name_the_problem(head: bytes, status: int, needle: str) -> None:
    with pytest.raises(HttpError) as err:
        parse_request_head(head)
    assert err.value.status == status and needle in err.value.message


def test_response_head_framing() -> None:
    fixed = parse_response_head(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                b"Content-Length: 5")
    assert (fixed.status, fixed.content_length, fixed.chunked, fixed.keep_alive) == \
        (200, 5, False, True)
    assert fixed.header(b"content-type") == b"application/json"
    stream = parse_response_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked")
    assert stream.chunked and stream.content_length is None and stream.keep_alive
    until_close = parse_response_head(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain")
    assert until_close.content_length is None and not until_close.keep_alive
    assert parse_response_head(b"HTTP/1.1 204 No Content").content_length == 0
    assert not parse_response_head(b"HTTP/1.1 200 OK\r\nConnection: close\r\n"
                                   b"Content-Length: 0").keep_alive
    with pytest.raises(HttpError) as err:
        parse_response_head(b"ICY 200 OK")
    assert err.value.status == 502


@pytest.mark.parametrize(("head", "needle"), [
    (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\nSet-Cookie: a=b", "0x0a"),
    (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\rSet-Cookie: a=b", "0x0d"),
    (b"HTTP/1.1 200 OK\r\nX-A: \x00", "0x00"),
    (b"HTTP/1.1 200 OK\r\nX-A: a\r\n\tb", "obs-fold"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked", "single"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity", "single"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2", "conflicting"),
    (b"HTTP/1.1 099 Odd", "status line"),
    (b"HTTP/1.1 600 Odd", "status line"),
    (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c", "101"),
])
def test_bad_response_heads_are_502(head: bytes, needle: str) -> None:
    with pytest.raises(HttpError) as err:
        parse_response_head(head)
    assert err.value.status == 502 and needle in err.value.message


def encode_chunked(parts: list[bytes], trailer: bytes = b"") -> bytes:
    return b"".join(encode_chunk(p) for p in parts if p) + b"0\r\n" + trailer + b"\r\n"


@given(st.lists(st.binary(min_size=0, max_size=50), max_size=6),
       st.lists(st.integers(min_value=0, max_value=400), max_size=8),
       st.binary(max_size=20))
def test_chunked_decoding_is_independent_of_how_bytes_arrive(parts: list[bytes],
                                                             cuts: list[int],
                                                             after: bytes) -> None:
    wire = encode_chunked(parts, trailer=b"X-Checksum: 1\r\n") + after
    points = sorted({min(c, len(wire)) for c in cuts} | {0, len(wire)})
    decoder = ChunkedDecoder()
    body, rest = b"", b""
    for a, b in itertools.pairwise(points):
        if decoder.done:
            rest += wire[a:b]
            continue
        out, leftover = decoder.feed(wire[a:b])
        body += b"".join(out)
        rest += leftover
    assert decoder.done
    assert body == b"".join(parts) and rest == after


@pytest.mark.parametrize("wire", [
    b"zz\r\nabc\r\n0\r\n\r\n",  # size is not hex
    b"+3\r\nabc\r\n0\r\n\r\n",  # int() would take a sign
    b"0x3\r\nabc\r\n0\r\n\r\n",  # ... and a prefix
    b"3\r\nabcd\r\n0\r\n\r\n",  # data longer than its size
    b"1" * 2000,  # a size line that never ends
    b" 3\r\nabc\r\n0\r\n\r\n",  # leading whitespace
    b"3\nabc\r\n0\r\n\r\n",  # a bare LF ends the size line
    b"3;a\nb\r\nabc\r\n0\r\n\r\n",  # a bare LF inside an extension
    b"3;\r\nabc\r\n0\r\n\r\n",  # an extension without a name
    b"3;a=\"x\r\nabc\r\n0\r\n\r\n",  # an unterminated quoted value
    b"3 4\r\nabc\r\n0\r\n\r\n",  # two numbers
    b"1111111111111111\r\n",  # 16 hex digits: past any body the gateway accepts
    b"0\r\nX-A: a\x00\r\n\r\n",  # a trailer with a control character
    b"0\r\nno colon\r\n\r\n",  # a trailer that is not a field line
    b"0\r\n" + b"X-A: 1\r\n" * 101 + b"\r\n",  # too many trailer lines
])
def test_bad_chunked_bodies_are_rejected(wire: bytes) -> None:
    """Chunk-size lines and trailers follow RFC 9112 7.1 exactly."""
    with pytest.raises(HttpError) as err:
        ChunkedDecoder().feed(wire)
    assert err.value.status == 400 and "chunk" in err.value.message


def test_chunk_extensions_in_their_grammar_are_accepted() -> None:
    wire = b"3 ; name=value ; flag ; q=\"a b\\\"c\"\r\nabc\r\n0\r\nX-T: 1\r\n\r\n"
    decoder = ChunkedDecoder()
    out, rest = decoder.feed(wire)
    assert decoder.done and out == [b"abc"] and rest == b""


@given(st.binary(max_size=300))
def test_arbitrary_request_heads_parse_or_fail_with_http_error(data: bytes) -> None:
    try:
        head = parse_request_head(data)
    except HttpError as err:
        assert 400 <= err.status < 600 and err.message
    else:
        assert head.path.startswith("/") and head.content_length >= 0


def test_status_lines() -> None:
    assert status_line(200) == b"HTTP/1.1 200 OK\r\n"
    assert status_line(599) == b"HTTP/1.1 599 \r\n"
