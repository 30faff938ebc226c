"""The agent's own Prometheus metrics, served with /healthz and /readyz (`--metrics-listen`).

Engine phases and restart counts are read from the supervisors when scraped
(a custom collector: no stale series for engines that went away); the
connection and reporting figures are kept as they happen. Label sets are
bounded by the host's deployments. Nothing secret: no tokens, no file paths of
credentials, only ids, phases and the controller's id and address.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gearshift.common.spec import Phase

# Reports are built from local scrapes with a 2 s timeout: buckets up to 10 s.
REPORT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class EngineView(Protocol):
    """What the collector reads of one supervised engine."""

    @property
    def phase(self) -> Phase: ...

    @property
    def restarts(self) -> int: ...

    @property
    def adopted(self) -> bool: ...


class _EngineCollector(Collector):
    def __init__(self, engines: Callable[[], Iterable[tuple[str, str, EngineView]]]) -> None:
        self._engines = engines

    def collect(self) -> Iterator[Metric]:
        phase = GaugeMetricFamily(
            "gearshift_agent_engine_phase",
            "1 for the phase each engine deployment is in, 0 for the others.",
            labels=["deployment_id", "engine", "phase"])
        restarts = CounterMetricFamily(
            "gearshift_agent_engine_restarts",
            "Times the agent restarted an engine after it exited (carried over on adoption).",
            labels=["deployment_id", "engine"])
        adopted = GaugeMetricFamily(
            "gearshift_agent_engine_adopted",
            "1 when the engine was started by a previous agent and adopted by this one.",
            labels=["deployment_id", "engine"])
        for dep_id, engine, view in self._engines():
            for p in Phase:
                phase.add_metric([dep_id, engine, p.value], 1.0 if view.phase is p else 0.0)
            restarts.add_metric([dep_id, engine], float(view.restarts))
            adopted.add_metric([dep_id, engine], 1.0 if view.adopted else 0.0)
        yield phase
        yield restarts
        yield adopted


class AgentMetrics:
    """One container per registry (tests pass a fresh one)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.connected = Gauge("gearshift_agent_connected",
                               "1 while a stream to a leading controller is open.", registry=r)
        self.connects = Counter("gearshift_agent_connects_total",
                                "Streams opened to a controller (welcome received).", registry=r)
        self.controller = Gauge(
            "gearshift_agent_controller_info",
            "1 for the controller this agent follows now (its id and address).",
            ["controller_id", "address"], registry=r)
        self.reports = Counter("gearshift_agent_reports_total",
                               "Reports sent to the controller.", registry=r)
        self.report_seconds = Histogram(
            "gearshift_agent_report_duration_seconds",
            "Time to build one report (GPU read, engine scrapes) and write it to the stream.",
            buckets=REPORT_BUCKETS_S, registry=r)
        self.last_report = Gauge("gearshift_agent_last_report_timestamp_seconds",
                                 "Unix time of the last report sent.", registry=r)
        self.adopted = Counter("gearshift_agent_engines_adopted_total",
                               "Engines taken over from a previous agent at start.", registry=r)

    def watch_engines(self, engines: Callable[[], Iterable[tuple[str, str, EngineView]]]) -> None:
        self.registry.register(_EngineCollector(engines))

    def following(self, controller_id: str, address: str) -> None:
        self.controller.clear()
        self.controller.labels(controller_id, address).set(1)
        self.connected.set(1)
        self.connects.inc()

    def disconnected(self) -> None:
        self.connected.set(0)
