"""The one error shape of the API port, OpenAI's, for the gateway's own errors and engines'.

Every error answer has the body

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

and keeps its HTTP status. `type` follows from the status alone (`error_type`): 401
`authentication_error`, 403 `permission_error`, 404 `not_found_error`, 429
`rate_limit_error`, any other 4xx `invalid_request_error`, 5xx `server_error`. `code` is a
string naming the case (the gateway's `model_not_found`, `no_endpoint`, … or an engine's own
string code) or null.

An engine's error answer is reshaped by `engine_error_body`: its message and a string `param`
are kept, a string `code` is kept and a numeric one dropped (vLLM's `"code": 400` repeats
the status), its `type` (vLLM's `"BadRequestError"`) is replaced by the status's. Read are
vLLM's `{"error": {...}}`, the top-level `{"object": "error", "message": ...}` of older vLLM
and of the other engines of the catalog, `{"error": "..."}` (vLLM's `--api-key` refusal), FastAPI's
`{"detail": ...}`, plain text, and a gzip or deflate body. Only answers not yet started are
reshaped: an error event inside a stream already under way is relayed as it is.
"""

from __future__ import annotations

import json
import zlib
from http import HTTPStatus
from typing import Any

# An engine's error body is read up to this to be reshaped; past it, the gateway's own message.
MAX_ERROR_BODY_BYTES = 64 * 1024

# The types that a status maps to; other 4xx are invalid_request_error, 5xx server_error.
_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          429: "rate_limit_error"}


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    if status >= 500:
        return "server_error"
    return _TYPES.get(status, "invalid_request_error")


def error_body(status: int, message: str, code: str | None = None,
               param: str | None = None) -> bytes:
    """An error body in the one shape, its `type` from `status`."""
    return json.dumps({"error": {"message": message, "type": error_type(status), "param": param,
                                 "code": code}}).encode()


def engine_error_body(status: int, body: bytes, encoding: bytes = b"") -> bytes:
    """An engine's error answer (`body`, with its Content-Encoding) in the one shape.

    A compressed body is inflated to at most MAX_ERROR_BODY_BYTES."""
    data = _decoded(body, encoding)
    message, code, param = _fields(data) if data is not None else ("", None, None)
    if not message:
        phrase = _phrase(status)
        message = f"The engine answered HTTP {status}{phrase} without a message."
        if data is None:
            message = (f"The engine answered HTTP {status}{phrase} in a Content-Encoding the "
                       "gateway does not read.")
    return error_body(status, message, code, param)


def _phrase(status: int) -> str:
    try:
        return f" ({HTTPStatus(status).phrase})"
    except ValueError:
        return ""


def _decoded(body: bytes, encoding: bytes) -> bytes | None:
    coding = encoding.strip().lower()
    if coding in (b"", b"identity"):
        return body
    if coding not in (b"gzip", b"x-gzip", b"deflate"):
        return None
    # gzip; "deflate" is the zlib format (RFC 9110 8.4.1.2), though some send raw deflate.
    for wbits in ((31,) if coding != b"deflate" else (15, -15)):
        try:
            return zlib.decompressobj(wbits).decompress(body, MAX_ERROR_BODY_BYTES)
        except zlib.error:
            continue
    return None


def _fields(data: bytes) -> tuple[str, str | None, str | None]:
    """(message, code, param) read from an engine's error body."""
    text = data.decode("utf-8", "replace").strip()
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return text, None, None
    if not isinstance(doc, dict):
        return text, None, None
    err: Any = doc.get("error", doc)
    if isinstance(err, str):
        return err, None, None
    if not isinstance(err, dict):
        err = doc
    message: Any = err.get("message", doc.get("detail"))
    if message is not None and not isinstance(message, str):
        try:
            message = json.dumps(message)
        except (ValueError, RecursionError):
            message = None
    code, param = err.get("code"), err.get("param")
    return (message or "", code if isinstance(code, str) and code else None,
            param if isinstance(param, str) and param else None)
