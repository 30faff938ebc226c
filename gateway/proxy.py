"""The OpenAI-compatible router: one HTTP endpoint in front of every model's deployments.

`Router` owns the current `RoutingTable`, the pool of kept-alive upstream
connections, and per-deployment counters reported to the controller. Requests
are routed by the JSON body's `model` (so every forwarded request body is read
whole first, within the listener's per-request and shared limits, and checked
for size and nesting depth before it is parsed). The answer is passed through
as-is: small bodies with a Content-Length whole (status, body, content type),
larger ones and streams in bounded pieces as they arrive (the engine is read no
faster than the client takes them). An error answer from an engine (status 400 or
more) is read only up to `MAX_ERROR_BODY_BYTES` and relayed with its status in the
gateway's one error shape (`errors`). Request bodies are forwarded byte for byte,
except where an engine serves the model under another name.

Error messages quote client input only cut to `MAX_ECHO_CHARS`; the unknown-model
404 does not list the models (GET /v1/models does).

Retries: a request moves to another endpoint only while nothing has been sent to
the client (connection refused or reset, a malformed or late response head, an
upstream 5xx, a short body not yet passed on, the stream ending before its first
chunk). Once the first byte is out, an upstream failure ends the client's response
abruptly (a chunked stream without its last chunk, a Content-Length body short, so
the client sees an error) and is counted as `truncated`, never retried.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gearshift.gateway.errors import MAX_ERROR_BODY_BYTES, engine_error_body, error_body
from gearshift.gateway.metrics import GatewayMetrics
from gearshift.gateway.pages import PAGES, find_page, model_not_found
from gearshift.gateway.request import JSON_HEADERS, Request
from gearshift.gateway.request_checks import (
    MAX_JSON_DEPTH,
    depth_within,
    forwarded_headers,
    shown,
)
from gearshift.gateway.routes import EMPTY_TABLE, FORWARDED_PATHS, Endpoint, RoutingTable
from gearshift.gateway.upstream import UpstreamConnectError, UpstreamConnection, UpstreamError
from gearshift.gateway.upstream_pool import UpstreamPool

log = logging.getLogger(__name__)

# Kept-alive connections to all upstreams together; requests beyond wait for one.
UPSTREAM_CONNECTIONS_LIMIT = 1024
UPSTREAM_CONNECT_TIMEOUT_S = 5.0
UPSTREAM_READ_TIMEOUT_S = 600.0  # for the response head: long non-streaming generations are normal
UPSTREAM_BODY_TIMEOUT_S = 60.0  # longest gap inside a response body (between stream events)
UPSTREAM_IDLE_TIMEOUT_S = 15.0  # a pooled connection unused this long is closed
MAX_ATTEMPTS = 3
SEND_JOINED_BYTES = 64 * 1024  # request bodies up to this go out in one write with the head
RELAY_WHOLE_BYTES = 256 * 1024  # Content-Length bodies up to this are read whole, larger relayed

UNKNOWN_MODEL_LABEL = "unknown"  # metric label for requests without a routed model
NO_DEPLOYMENT_LABEL = "none"


@dataclass(slots=True)
class DeploymentStats:
    """Counters for one deployment, reported to the controller."""

    deployment_id: str
    in_flight: int = 0
    requests_total: int = 0
    errors_total: int = 0


@dataclass(slots=True)
class _Answer:
    """A whole response kept to pass on if no other endpoint does better."""

    status: int
    headers: bytes
    body: bytes


class _Retry(Exception):
    """An attempt failed before the first byte; `answer` is a 5xx to pass on if nothing else works."""

    def __init__(self, reason: str, answer: _Answer | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.answer = answer


def _error(request: Request, status: int, message: str, code: str,
           param: str | None = None) -> None:
    request.respond(status, error_body(status, message, code, param))


class Router:
    """Routes OpenAI requests to the deployments of the routing table."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        table: RoutingTable | None = None,
        rng: Callable[[], float] | None = None,
        connections_limit: int = UPSTREAM_CONNECTIONS_LIMIT,
        read_timeout_s: float = UPSTREAM_READ_TIMEOUT_S,
        body_timeout_s: float = UPSTREAM_BODY_TIMEOUT_S,
    ) -> None:
        self.metrics = metrics
        self.table = EMPTY_TABLE if table is None else table
        self.table_loaded = table is not None
        self._rng = rng or random.Random().random
        self._stats: dict[str, DeploymentStats] = {}
        self._pool = UpstreamPool(limit=connections_limit,
                                  connect_timeout_s=UPSTREAM_CONNECT_TIMEOUT_S,
                                  read_timeout_s=read_timeout_s,
                                  idle_timeout_s=UPSTREAM_IDLE_TIMEOUT_S,
                                  body_timeout_s=body_timeout_s)

    # -- table and counters -------------------------------------------------------

    def set_table(self, table: RoutingTable) -> None:
        """Replace the routing table; requests in flight keep the endpoint they have. The
        counters of a deployment no longer routed, with nothing in flight, are dropped:
        the controller keeps only routed ones, and a gateway's report stays the fleet's
        size however many deployments came and went."""
        self.table = table
        self.table_loaded = True
        routed = {e.deployment_id for eps in table.models.values() for e in eps}
        for dep_id in [d for d, s in self._stats.items() if d not in routed and not s.in_flight]:
            del self._stats[dep_id]

    def deployment_stats(self) -> list[DeploymentStats]:
        """A snapshot of every deployment's counters (in flight, requests, errors)."""
        return [DeploymentStats(s.deployment_id, s.in_flight, s.requests_total, s.errors_total)
                for s in self._stats.values()]

    def _stat(self, deployment_id: str) -> DeploymentStats:
        s = self._stats.get(deployment_id)
        if s is None:
            s = self._stats[deployment_id] = DeploymentStats(deployment_id)
        return s

    def close(self) -> None:
        """Close the upstream connections (after the listeners stopped)."""
        self._pool.close()

    # -- dispatch -----------------------------------------------------------------

    async def handle(self, request: Request) -> None:
        """The listener's handler: forwarded POSTs, the small GET pages, 404/405 otherwise."""
        path = request.path
        if path in FORWARDED_PATHS:
            if request.method != b"POST":
                _error(request, 405, f"{path} takes POST, not {shown(request.method)}.",
                       "method_not_allowed")
                return
            await self._forward(request, path)
            return
        page = find_page(path)
        if page is None:
            _error(request, 404, f"No route for {shown(path)}; the gateway serves "
                   f"{', '.join(FORWARDED_PATHS)}, {', '.join(PAGES)}.", "not_found")
        elif request.method not in (b"GET", b"HEAD"):
            _error(request, 405, f"{shown(path)} takes GET, not {shown(request.method)}.",
                   "method_not_allowed")
        else:
            page(request, self.table, self.table_loaded)

    # -- forwarding -----------------------------------------------------------------

    async def _forward(self, request: Request, path: str) -> None:
        t0 = time.perf_counter()
        body = request.body
        model = self._model_of(request, body)
        if model is None:
            return
        table = self.table
        if model not in table.models:
            self.metrics.error(UNKNOWN_MODEL_LABEL, "unknown_model")
            self.metrics.request_done(UNKNOWN_MODEL_LABEL, NO_DEPLOYMENT_LABEL, 404)
            request.respond(404, model_not_found(model))
            return
        headers = forwarded_headers(request.head.headers)
        tried: list[Endpoint] = []
        last: _Retry | None = None
        while len(tried) < MAX_ATTEMPTS:
            ep = table.pick(model, exclude=tried, rng=self._rng)
            if ep is None:
                break
            if tried:
                self.metrics.retry(model)
            tried.append(ep)
            try:
                await self._attempt(request, ep, path, body, headers, model, t0)
                return
            except _Retry as retry:
                last = retry
                log.debug("model %s: %s failed before the first byte (%s); trying another",
                          model, ep.endpoint, retry.reason)
        if last is None:
            self.metrics.error(model, "no_endpoint")
            self.metrics.request_done(model, NO_DEPLOYMENT_LABEL, 503)
            _error(request, 503, f"No healthy endpoint for model `{model}` right now.",
                   "no_endpoint", "model")
            return
        if last.answer is not None:
            self.metrics.error(model, "upstream_5xx")
            self.metrics.request_done(model, tried[-1].deployment_id, last.answer.status)
            self.metrics.first_byte(model, time.perf_counter() - t0)
            request.respond(last.answer.status, last.answer.body, last.answer.headers)
            return
        self.metrics.error(model, "upstream_unavailable")
        self.metrics.request_done(model, tried[-1].deployment_id, 502)
        _error(request, 502, f"Every endpoint tried for model `{model}` failed "
               f"({len(tried)} tried; last: {last.reason}).", "upstream_unavailable", "model")

    def _model_of(self, request: Request, body: bytes) -> str | None:
        """The body's `model`, or None after answering 400."""
        message, code = "", "invalid_json"
        try:
            payload: Any = json.loads(body)
        except ValueError as err:
            message = f"Request body is not valid JSON: {err}."
        except RecursionError:  # the parser's own depth limit (about 1000 levels)
            message = f"Request body nests objects and arrays more than {MAX_JSON_DEPTH} deep."
            code = "json_too_deep"
        else:
            if not depth_within(body, payload, MAX_JSON_DEPTH):
                message = (f"Request body nests objects and arrays more than {MAX_JSON_DEPTH} "
                           "deep.")
                code = "json_too_deep"
            elif not isinstance(payload, dict):
                message = f"Request body must be a JSON object, got {type(payload).__name__}."
            else:
                model = payload.get("model")
                if isinstance(model, str) and model:
                    return model
                message = "Request body needs a `model` string naming the model to use."
                code = "missing_model"
        self.metrics.error(UNKNOWN_MODEL_LABEL, "bad_request")
        self.metrics.request_done(UNKNOWN_MODEL_LABEL, NO_DEPLOYMENT_LABEL, 400)
        _error(request, 400, message, code, "model" if code == "missing_model" else None)
        return None

    async def _attempt(self, request: Request, ep: Endpoint, path: str, body: bytes,
                       headers: bytes, model: str, t0: float) -> None:
        stat = self._stat(ep.deployment_id)
        gauge = self.metrics.in_flight_gauge(model, ep.deployment_id)
        stat.in_flight += 1
        gauge.inc()
        rename = _rename(model, ep.served_model_name)
        if rename is not None:
            # The engine answers to another name (trtllm-serve serves its checkpoint path):
            # ask under that name and give the client back the name it used.
            payload = json.loads(body)
            payload["model"] = ep.served_model_name
            body = json.dumps(payload).encode()
        data = b"%s%sContent-Length: %d\r\n\r\n" % (ep.request_starts[path], headers, len(body))
        if len(body) <= SEND_JOINED_BYTES:  # one write for the usual small request
            data, body = data + body, b""
        try:
            try:
                upstream = await self._pool.request(ep.upstream_key, data, body)
            except UpstreamError as err:
                stat.errors_total += 1
                if isinstance(err, UpstreamConnectError):
                    ep.eject(time.monotonic())
                raise _Retry(f"{type(err).__name__}: {err}") from None
            try:
                await self._relay(request, upstream, ep, stat, model, t0, rename)
            finally:
                self._pool.release(upstream)
        finally:
            stat.in_flight -= 1
            gauge.dec()

    async def _relay(self, request: Request, upstream: UpstreamConnection, ep: Endpoint,
                     stat: DeploymentStats, model: str, t0: float,
                     rename: tuple[bytes, bytes] | None) -> None:
        head = upstream.head
        assert head is not None
        if head.status >= 400:
            answer = await _error_answer(upstream, head.status, head.header(b"content-encoding"))
            if answer is None or head.status >= 500:
                stat.errors_total += 1
                raise _Retry(f"HTTP {head.status}" + ("" if answer else ", its body broke off"),
                             answer)
            stat.requests_total += 1
            self.metrics.request_done(model, ep.deployment_id, head.status)
            self.metrics.first_byte(model, time.perf_counter() - t0)
            body = answer.body if rename is None else answer.body.replace(*rename)
            request.respond(answer.status, body)
            return
        ctype = head.header(b"content-type") or b"application/octet-stream"
        out_headers = b"Content-Type: " + ctype + b"\r\n"
        encoding = head.header(b"content-encoding")
        if encoding:
            out_headers += b"Content-Encoding: " + encoding + b"\r\n"
        event_stream = ctype.lower().startswith(b"text/event-stream")
        length = head.content_length
        whole = not event_stream and length is not None and length <= RELAY_WHOLE_BYTES
        try:
            data = await (upstream.read() if whole else upstream.readany())
        except UpstreamError as err:
            stat.errors_total += 1
            raise _Retry(f"reading response: {type(err).__name__}: {err}") from None
        if not whole and not data and upstream.at_eof and head.status == 200 and event_stream:
            stat.errors_total += 1
            raise _Retry("stream ended before its first chunk")
        stat.requests_total += 1
        self.metrics.request_done(model, ep.deployment_id, head.status)
        if rename is not None:
            data = data.replace(*rename)
        if whole:
            self.metrics.first_byte(model, time.perf_counter() - t0)
            request.respond(head.status, data, out_headers)
            return
        if event_stream:
            out_headers += b"Cache-Control: no-cache\r\n"
        # A large body keeps the engine's Content-Length unless renaming changes its size.
        keep_length = length if not event_stream and rename is None else None
        await self._stream(request, upstream, head.status, data, out_headers, keep_length,
                           stat, model, t0, rename)

    async def _stream(self, request: Request, upstream: UpstreamConnection, status: int,
                      first: bytes, headers: bytes, length: int | None, stat: DeploymentStats,
                      model: str, t0: float, rename: tuple[bytes, bytes] | None) -> None:
        try:
            request.start_stream(status, headers, length)
            self.metrics.first_byte(model, time.perf_counter() - t0)
            await request.write(first)
        except ConnectionError:
            self.metrics.error(model, "client_disconnected")
            upstream.close()
            return
        while True:
            try:
                chunk = await upstream.readany()
            except UpstreamError as err:
                stat.errors_total += 1
                self.metrics.error(model, "truncated")
                log.warning("model %s: response from %s:%d broke after the first byte (%s: %s); "
                            "ending the client's response", model, upstream.key[0],
                            upstream.key[1], type(err).__name__, err)
                upstream.close()
                request.abort()  # no clean end: the client must see it
                return
            if not chunk:
                break
            if rename is not None:
                chunk = chunk.replace(*rename)
            try:
                await request.write(chunk)
            except ConnectionError:
                self.metrics.error(model, "client_disconnected")
                upstream.close()
                return
        request.end_stream()


async def _error_answer(upstream: UpstreamConnection, status: int,
                        encoding: bytes | None) -> _Answer | None:
    """An engine's error answer in the one error shape (`errors.engine_error_body`).

    Its body is read only up to MAX_ERROR_BODY_BYTES; a larger one is replaced by the
    gateway's own message with the same status, and so is a 5xx body that breaks off.
    None for a 4xx body that breaks off: the request may be retried elsewhere."""
    pieces: list[bytes] = []
    size = 0
    reason = ""
    try:
        while True:
            piece = await upstream.readany()
            if not piece:
                break
            size += len(piece)
            if size > MAX_ERROR_BODY_BYTES:
                reason = f"its body is larger than {MAX_ERROR_BODY_BYTES} bytes"
                break
            pieces.append(piece)
    except UpstreamError as err:
        if status < 500:
            upstream.close()
            return None
        reason = f"its body broke off ({err})"
    if not reason:
        return _Answer(status, JSON_HEADERS, engine_error_body(status, b"".join(pieces),
                                                               encoding or b""))
    upstream.close()
    body = error_body(status, f"The engine answered HTTP {status}; {reason}.", "upstream_error")
    return _Answer(status, JSON_HEADERS, body)


def _rename(model: str, served: str) -> tuple[bytes, bytes] | None:
    """(engine's name, client's name) as JSON strings, or None when they are the same."""
    if not served or served == model:
        return None
    return json.dumps(served).encode(), json.dumps(model).encode()
