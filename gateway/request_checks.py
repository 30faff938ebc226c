"""Checks on a client's request before it is routed, and what of it is passed on.

`forwarded_headers` drops hop-by-hop headers (and those the Connection header
names); `depth_within` bounds how deeply a JSON body nests, so no parser or
serializer down the line recurses without limit; `shown` cuts client input
quoted in an error message, so an error never echoes megabytes back.
"""

from __future__ import annotations

from typing import Any

MAX_JSON_DEPTH = 64  # nesting of objects and arrays in a request body
MAX_ECHO_CHARS = 64  # client input quoted in an error message

# Request headers that belong to one hop, or that the gateway sets itself.
_HOP_HEADERS = frozenset({
    b"host", b"content-length", b"connection", b"keep-alive", b"proxy-connection",
    b"transfer-encoding", b"te", b"trailer", b"upgrade", b"proxy-authorization",
    b"proxy-authenticate", b"expect",
})


def forwarded_headers(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The request headers to pass upstream, as a header block (hop-by-hop ones dropped)."""
    hop: frozenset[bytes] | set[bytes] = _HOP_HEADERS
    for name, value in headers:
        if name.lower() == b"connection":  # it may name more hop-by-hop headers
            named = {t.strip().lower() for t in value.split(b",")} - {b"close", b"keep-alive", b""}
            if named:
                hop = _HOP_HEADERS | named
    return b"".join([b"%s: %s\r\n" % (name, value) for name, value in headers
                     if name.lower() not in hop])


def shown(value: str | bytes) -> str:
    """Client input quoted in an error message: cut to MAX_ECHO_CHARS, as a repr."""
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    if len(text) > MAX_ECHO_CHARS:
        return repr(text[:MAX_ECHO_CHARS]) + f"… ({len(text)} characters)"
    return repr(text)


def depth_within(body: bytes, payload: Any, limit: int) -> bool:
    """Whether `payload` (parsed from `body`) nests objects and arrays at most `limit` deep."""
    if body.count(b"[") + body.count(b"{") <= limit:  # cannot be deeper than its brackets
        return True
    stack: list[tuple[Any, int]] = [(payload, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values() if isinstance(v, dict | list))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value if isinstance(v, dict | list))
    return True
