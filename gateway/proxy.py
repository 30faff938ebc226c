"""The OpenAI-compatible router: one HTTP endpoint in front of every model's deployments.

`Router` owns the current `RoutingTable`, one pooled aiohttp `ClientSession` to the
upstreams, and per-deployment counters reported to the controller. Requests are
routed by the JSON body's `model`; the answer is passed through as-is:
non-streaming bodies whole (status, body, content type), streams chunk by chunk as
they arrive, never buffered.

Retries: a request moves to another endpoint only while nothing has been sent to
the client (connection refused or reset, an upstream 5xx, the stream ending before
its first chunk). Once the first byte is out, an upstream failure ends the client's
response abruptly (so the client sees a truncated response) and is counted, never
retried.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from gearshift.gateway.metrics import GatewayMetrics
from gearshift.gateway.routes import EMPTY_TABLE, Endpoint, RoutingTable

log = logging.getLogger(__name__)

# Keep-alive connections to all upstreams together; requests beyond wait for one.
UPSTREAM_CONNECTIONS_LIMIT = 1024
UPSTREAM_CONNECT_TIMEOUT_S = 5.0
UPSTREAM_READ_TIMEOUT_S = 600.0  # long non-streaming generations are normal
CLIENT_MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_ATTEMPTS = 3

# Request headers that belong to one hop, or that aiohttp sets itself.
_HOP_HEADERS = frozenset({
    "host", "content-length", "connection", "keep-alive", "proxy-connection",
    "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization",
    "proxy-authenticate", "expect",
})
_RETRYABLE_ERRORS = (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError)
UNKNOWN_MODEL_LABEL = "unknown"  # metric label for requests without a routed model
NO_DEPLOYMENT_LABEL = "none"


@dataclass(slots=True)
class DeploymentStats:
    """Counters for one deployment, reported to the controller."""

    deployment_id: str
    in_flight: int = 0
    requests_total: int = 0
    errors_total: int = 0


class _Retry(Exception):
    """An attempt failed before the first byte; `response` is a 5xx to pass on if nothing else works."""

    def __init__(self, reason: str, response: web.Response | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.response = response


def openai_error(status: int, message: str, err_type: str, code: str,
                 param: str | None = None) -> web.Response:
    """An error response in the OpenAI shape: {"error": {message, type, param, code}}."""
    body = {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    return web.json_response(body, status=status)


class Router:
    """Routes OpenAI requests to the deployments of the routing table."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        table: RoutingTable | None = None,
        rng: Callable[[], float] | None = None,
        connections_limit: int = UPSTREAM_CONNECTIONS_LIMIT,
    ) -> None:
        self.metrics = metrics
        self.table = EMPTY_TABLE if table is None else table
        self.table_loaded = table is not None
        self._rng = rng or random.Random().random
        self._connections_limit = connections_limit
        self._stats: dict[str, DeploymentStats] = {}
        self._session: aiohttp.ClientSession | None = None

    # -- table and counters -------------------------------------------------------

    def set_table(self, table: RoutingTable) -> None:
        """Replace the routing table; requests in flight keep the endpoint they have."""
        self.table = table
        self.table_loaded = True

    def deployment_stats(self) -> list[DeploymentStats]:
        """A snapshot of every deployment's counters (in flight, requests, errors)."""
        return [DeploymentStats(s.deployment_id, s.in_flight, s.requests_total, s.errors_total)
                for s in self._stats.values()]

    def _stat(self, deployment_id: str) -> DeploymentStats:
        s = self._stats.get(deployment_id)
        if s is None:
            s = self._stats[deployment_id] = DeploymentStats(deployment_id)
        return s

    # -- aiohttp wiring -----------------------------------------------------------

    def make_app(self, metrics_route: bool = True) -> web.Application:
        """The gateway's web application; the upstream session lives with the app."""
        app = web.Application(client_max_size=CLIENT_MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        if metrics_route:
            app.router.add_get("/metrics", self.metrics_handler)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=self._connections_limit, limit_per_host=0,
                                         ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=UPSTREAM_CONNECT_TIMEOUT_S,
                                          sock_read=UPSTREAM_READ_TIMEOUT_S),
        )

    async def _close(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def metrics_handler(self, _request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- small endpoints ----------------------------------------------------------

    async def _models(self, _request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "gearshift"}
                for m in self.table.model_names()]
        return web.json_response({"object": "list", "data": data})

    async def _health(self, _request: web.Request) -> web.Response:
        body = {"status": "ok" if self.table_loaded else "no routing table yet",
                "routes_version": self.table.version, "routes_source": self.table.source,
                "models": len(self.table.models)}
        return web.json_response(body, status=200 if self.table_loaded else 503)

    # -- forwarding -----------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._forward(request, "/v1/completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._forward(request, "/v1/chat/completions")

    async def _forward(self, request: web.Request, path: str) -> web.StreamResponse:
        t0 = time.perf_counter()
        body = await request.read()
        model, bad = self._model_of(body)
        if bad is not None:
            self.metrics.error(UNKNOWN_MODEL_LABEL, "bad_request")
            self.metrics.request_done(UNKNOWN_MODEL_LABEL, NO_DEPLOYMENT_LABEL, bad.status)
            return bad
        table = self.table
        if model not in table.models:
            known = ", ".join(table.model_names()) or "(none)"
            self.metrics.error(UNKNOWN_MODEL_LABEL, "unknown_model")
            self.metrics.request_done(UNKNOWN_MODEL_LABEL, NO_DEPLOYMENT_LABEL, 404)
            return openai_error(404, f"The model `{model}` does not exist on this gateway. "
                                f"Known models: {known}.", "invalid_request_error",
                                "model_not_found", "model")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
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
                return await self._attempt(request, ep, path, body, headers, model, t0)
            except _Retry as retry:
                last = retry
                log.debug("model %s: %s failed before the first byte (%s); trying another",
                          model, ep.endpoint, retry.reason)
        if last is None:
            self.metrics.error(model, "no_endpoint")
            self.metrics.request_done(model, NO_DEPLOYMENT_LABEL, 503)
            return openai_error(503, f"No healthy endpoint for model `{model}` right now.",
                                "service_unavailable", "no_endpoint", "model")
        if last.response is not None:
            self.metrics.error(model, "upstream_5xx")
            self.metrics.request_done(model, tried[-1].deployment_id, last.response.status)
            self.metrics.first_byte(model, time.perf_counter() - t0)
            return last.response
        self.metrics.error(model, "upstream_unavailable")
        self.metrics.request_done(model, tried[-1].deployment_id, 502)
        return openai_error(502, f"Every endpoint tried for model `{model}` failed "
                            f"({len(tried)} tried; last: {last.reason}).", "upstream_error",
                            "upstream_unavailable", "model")

    @staticmethod
    def _model_of(body: bytes) -> tuple[str, web.Response | None]:
        try:
            payload: Any = json.loads(body)
        except ValueError as err:
            return "", openai_error(400, f"Request body is not valid JSON: {err}.",
                                    "invalid_request_error", "invalid_json")
        if not isinstance(payload, dict):
            return "", openai_error(400, "Request body must be a JSON object, got "
                                    f"{type(payload).__name__}.", "invalid_request_error",
                                    "invalid_json")
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            return "", openai_error(400, "Request body needs a `model` string naming the "
                                    "model to use.", "invalid_request_error", "missing_model",
                                    "model")
        return model, None

    async def _attempt(self, request: web.Request, ep: Endpoint, path: str, body: bytes,
                       headers: dict[str, str], model: str, t0: float) -> web.StreamResponse:
        assert self._session is not None, "router app not started"
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
            headers = {k: v for k, v in headers.items() if k.lower() != "content-length"}
        try:
            try:
                upstream = await self._session.post(ep.urls[path], data=body, headers=headers)
            except _RETRYABLE_ERRORS as err:
                stat.errors_total += 1
                if isinstance(err, aiohttp.ClientConnectorError):
                    ep.eject(time.monotonic())
                raise _Retry(f"{type(err).__name__}: {err}") from None
            try:
                return await self._relay(request, upstream, ep, stat, model, t0, rename)
            finally:
                upstream.release()
        finally:
            stat.in_flight -= 1
            gauge.dec()

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse,
                     ep: Endpoint, stat: DeploymentStats, model: str,
                     t0: float, rename: tuple[bytes, bytes] | None = None) -> web.StreamResponse:
        ctype = upstream.headers.get("Content-Type", "application/octet-stream")
        out_headers = {"Content-Type": ctype}
        encoding = upstream.headers.get("Content-Encoding")
        if encoding:
            out_headers["Content-Encoding"] = encoding
        streaming = ctype.startswith("text/event-stream") or upstream.content_length is None
        try:
            data = await (upstream.content.readany() if streaming else upstream.read())
        except _RETRYABLE_ERRORS as err:
            stat.errors_total += 1
            upstream.close()
            raise _Retry(f"reading response: {type(err).__name__}: {err}") from None
        if upstream.status >= 500:
            stat.errors_total += 1
            if streaming:  # collect the (short) error body so it can be passed on whole
                try:
                    data += await upstream.read()
                except _RETRYABLE_ERRORS:
                    upstream.close()
            raise _Retry(f"HTTP {upstream.status}",
                         web.Response(body=data, status=upstream.status, headers=out_headers))
        if streaming and not data and upstream.content.at_eof() and upstream.status == 200 \
                and ctype.startswith("text/event-stream"):
            stat.errors_total += 1
            raise _Retry("stream ended before its first chunk")
        stat.requests_total += 1
        self.metrics.request_done(model, ep.deployment_id, upstream.status)
        if rename is not None:
            data = data.replace(*rename)
        if not streaming:
            self.metrics.first_byte(model, time.perf_counter() - t0)
            return web.Response(body=data, status=upstream.status, headers=out_headers)
        return await self._stream(request, upstream, data, out_headers, stat, model, t0, rename)

    async def _stream(self, request: web.Request, upstream: aiohttp.ClientResponse,
                      first: bytes, headers: dict[str, str], stat: DeploymentStats,
                      model: str, t0: float,
                      rename: tuple[bytes, bytes] | None = None) -> web.StreamResponse:
        out = web.StreamResponse(status=upstream.status, headers=headers)
        out.headers["Cache-Control"] = "no-cache"
        try:
            await out.prepare(request)
            self.metrics.first_byte(model, time.perf_counter() - t0)
            if first:
                await out.write(first)
        except ConnectionError:
            self.metrics.error(model, "client_disconnected")
            upstream.close()
            return out
        while True:
            try:
                chunk = await upstream.content.readany()
            except _RETRYABLE_ERRORS as err:
                stat.errors_total += 1
                self.metrics.error(model, "truncated")
                log.warning("model %s: stream from %s broke after the first byte (%s: %s); "
                            "ending the client's response", model, _origin(upstream),
                            type(err).__name__, err)
                upstream.close()
                if request.transport is not None:  # no clean end: the client must see it
                    request.transport.close()
                return out
            if not chunk:
                break
            if rename is not None:
                chunk = chunk.replace(*rename)
            try:
                await out.write(chunk)
            except ConnectionError:
                self.metrics.error(model, "client_disconnected")
                upstream.close()
                return out
        return out


def _rename(model: str, served: str) -> tuple[bytes, bytes] | None:
    """(engine's name, client's name) as JSON strings, or None when they are the same."""
    if not served or served == model:
        return None
    return json.dumps(served).encode(), json.dumps(model).encode()


def _origin(upstream: aiohttp.ClientResponse) -> str:
    return f"{upstream.url.scheme}://{upstream.url.host}:{upstream.url.port}"
