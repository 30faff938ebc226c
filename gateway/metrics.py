"""Prometheus metrics of the gateway: what clients see, per model and deployment.

One container with an injectable `registry=` so tests get a fresh registry.
Label children are cached because `.labels()` takes a lock and builds a key on
every call, which matters at thousands of requests per second.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.registry import REGISTRY

from gearshift.gateway.limits import ClientLimits

# The `reason` of gearshift_gateway_errors_total: the clients' own errors, and failures on
# the serving side (the alert GearshiftGatewayUpstreamErrors counts these only; a test
# checks both against what the proxy emits and what deploy/prometheus/rules.yaml matches).
CLIENT_ERROR_REASONS = frozenset({"unknown_model", "bad_request", "client_disconnected"})
UPSTREAM_ERROR_REASONS = frozenset({"no_endpoint", "upstream_5xx", "upstream_unavailable",
                                    "truncated"})

# Time to first byte buckets (seconds): fine below 10 ms where gateway overhead lives.
TTFT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                  10.0, 30.0)


class GatewayMetrics:
    """The gateway's Prometheus metrics."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = REGISTRY if registry is None else registry
        self.requests_total = Counter(
            "gearshift_gateway_requests_total",
            "Requests answered by the gateway, by model, deployment and HTTP status code.",
            ["model", "deployment", "code"], registry=self.registry)
        self.errors_total = Counter(
            "gearshift_gateway_errors_total",
            "Requests that failed as the client sees them, by model and reason (the client's "
            "own: unknown_model, bad_request, client_disconnected; upstream: no_endpoint, "
            "upstream_5xx, upstream_unavailable, truncated).",
            ["model", "reason"], registry=self.registry)
        self.ttft_seconds = Histogram(
            "gearshift_gateway_ttft_seconds",
            "Time from receiving a request to sending its first response byte.",
            ["model"], buckets=TTFT_BUCKETS_S, registry=self.registry)
        self.in_flight = Gauge(
            "gearshift_gateway_in_flight",
            "Requests in flight through the gateway, by model and deployment.",
            ["model", "deployment"], registry=self.registry)
        self.retries_total = Counter(
            "gearshift_gateway_retries_total",
            "Requests retried on another endpoint before the first byte, by model.",
            ["model"], registry=self.registry)
        self.client_connections = Gauge(
            "gearshift_gateway_client_connections",
            "Client connections open on the API listener.", registry=self.registry)
        self.client_connections_limit = Gauge(
            "gearshift_gateway_client_connections_limit",
            "Most client connections the API listener keeps open.", registry=self.registry)
        self.body_bytes = Gauge(
            "gearshift_gateway_request_body_bytes",
            "Request bytes charged to the shared budget: bodies in progress, and unfinished "
            "heads and pipelined requests past a small allowance per connection.",
            registry=self.registry)
        self.body_budget_bytes = Gauge(
            "gearshift_gateway_request_body_budget_bytes",
            "Most request bytes (mostly bodies) the gateway holds at once.",
            registry=self.registry)
        self.client_refusals_total = Counter(
            "gearshift_gateway_client_refusals_total",
            "Client requests or connections refused before routing, by reason (bad_request, "
            "too_large, timeout, connection_limit, body_budget).",
            ["reason"], registry=self.registry)
        self._requests: dict[tuple[str, str, str], Counter] = {}
        self._ttft: dict[str, Histogram] = {}
        self._in_flight: dict[tuple[str, str], Gauge] = {}

    def track_clients(self, limits: ClientLimits, connections: Callable[[], int],
                      body_bytes: Callable[[], int]) -> None:
        """Report the API listener's limits and, read at scrape time, its usage."""
        self.client_connections_limit.set(limits.max_connections)
        self.body_budget_bytes.set(limits.body_budget_bytes)
        self.client_connections.set_function(connections)
        self.body_bytes.set_function(body_bytes)

    def refused(self, reason: str) -> None:
        self.client_refusals_total.labels(reason).inc()

    def request_done(self, model: str, deployment: str, code: int) -> None:
        key = (model, deployment, str(code))
        child = self._requests.get(key)
        if child is None:
            child = self._requests[key] = self.requests_total.labels(*key)
        child.inc()

    def error(self, model: str, reason: str) -> None:
        self.errors_total.labels(model, reason).inc()

    def retry(self, model: str) -> None:
        self.retries_total.labels(model).inc()

    def first_byte(self, model: str, seconds: float) -> None:
        child = self._ttft.get(model)
        if child is None:
            child = self._ttft[model] = self.ttft_seconds.labels(model)
        child.observe(seconds)

    def in_flight_gauge(self, model: str, deployment: str) -> Gauge:
        key = (model, deployment)
        child = self._in_flight.get(key)
        if child is None:
            child = self._in_flight[key] = self.in_flight.labels(*key)
        return child
