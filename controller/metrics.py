"""The controller's Prometheus metrics: one container, injectable registry, base units."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ControllerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.reports = Counter(
            "gearshift_controller_reports", "Agent reports accepted.", registry=r)
        self.deployment_samples = Counter(
            "gearshift_controller_deployment_samples",
            "Per-deployment samples received in reports.", registry=r)
        self.rejected = Counter(
            "gearshift_controller_rejected_messages",
            "Agent messages refused, by reason.", ["reason"], registry=r)
        self.report_seconds = Histogram(
            "gearshift_controller_report_handle_seconds",
            "Time to apply one report to the fleet state.",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05), registry=r)
        self.agents_connected = Gauge(
            "gearshift_controller_agent_streams", "Open agent streams.", registry=r)
        self.hosts = Gauge(
            "gearshift_controller_hosts", "Known hosts by state.", ["state"], registry=r)
        self.deployments = Gauge(
            "gearshift_controller_deployments", "Known deployments by engine and phase.",
            ["engine", "phase"], registry=r)
        self.route_version = Gauge(
            "gearshift_controller_routing_table_version", "Version of the routing table.",
            registry=r)
