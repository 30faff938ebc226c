"""The controller's Prometheus metrics: one container, injectable registry, base units.

docs/observability.md lists every metric with what it means and the alerts built on
it (deploy/prometheus/rules.yaml). Label sets are bounded: states, phases, kinds and
results are enums; `rule` is a rule name of the applied policy; `engine` and `model`
are the fleet's engines and served models (no host or deployment ids).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import suppress
from enum import Enum
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gearshift.controller.moves.machine import (
    TERMINAL_PHASES,
    MigrationKind,
    MigrationPhase,
)

if TYPE_CHECKING:
    from gearshift.controller.moves.store import MigrationRow
    from gearshift.controller.store.tables import RollupRow

# A move lasts minutes to hours (an engine build can take an hour).
MIGRATION_DURATION_BUCKETS_S = (30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0,
                                7200.0, 14400.0)
ACTIVE_MIGRATION_PHASES = tuple(p for p in MigrationPhase if p.active)
MIGRATION_RESULTS = tuple(p for p in MigrationPhase if p in TERMINAL_PHASES)


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
        self.enrolments = Counter(
            "gearshift_controller_enrolments",
            "Enrolment and renewal requests by outcome: issued, pending, renewed, refused.",
            ["outcome"], registry=r)
        self.revoked_hosts = Gauge(
            "gearshift_controller_revoked_hosts", "Hosts refused as revoked (from the store).",
            registry=r)
        self.route_version = Gauge(
            "gearshift_controller_routing_table_version", "Version of the routing table.",
            registry=r)

        # -- decisions, migrations, leadership, engine restarts (the alerts' signals) ------
        self.decisions = Counter(
            "gearshift_controller_decisions",
            "Decisions by the policy rule that made them and each status they entered "
            "(outcome: proposed when made, then approved, executing, done, rolled_back, "
            "superseded or rejected).", ["rule", "outcome"], registry=r)
        self.migrations_started = Counter(
            "gearshift_controller_migrations_started",
            "Migrations created, by kind.", ["kind"], registry=r)
        self.migration_transitions = Counter(
            "gearshift_controller_migration_transitions",
            "Migration phase transitions, by kind and the phase entered.",
            ["kind", "phase"], registry=r)
        self.migrations_ended = Counter(
            "gearshift_controller_migrations_ended",
            "Migrations that ended, by kind and result (done, rolled_back, aborted).",
            ["kind", "result"], registry=r)
        self.migration_seconds = Histogram(
            "gearshift_controller_migration_duration_seconds",
            "Time from a migration's creation to its end, by kind and result.",
            ["kind", "result"], buckets=MIGRATION_DURATION_BUCKETS_S, registry=r)
        self.migrations_in_flight = Gauge(
            "gearshift_controller_migrations_in_flight",
            "Active migrations by kind and phase (the leader's; 0 on followers).",
            ["kind", "phase"], registry=r)
        self.migrations_past_deadline = Gauge(
            "gearshift_controller_migrations_past_deadline",
            "Active migrations that stayed in their phase past its deadline (stuck), by phase.",
            ["phase"], registry=r)
        self.migration_oldest_age = Gauge(
            "gearshift_controller_migration_oldest_age_seconds",
            "Age of the oldest active migration (0 when none).", registry=r)
        self.is_leader = Gauge(
            "gearshift_controller_is_leader",
            "1 while this controller leads (acts on the fleet), 0 while it follows.",
            registry=r)
        self.leader_epoch = Gauge(
            "gearshift_controller_leader_epoch",
            "Fencing epoch of the term this controller leads or last led (0: never led).",
            registry=r)
        self.engine_restarts = Counter(
            "gearshift_controller_engine_restarts",
            "Engine restarts seen in agents' reports, by engine and model.",
            ["engine", "model"], registry=r)
        self.crash_looping = Gauge(
            "gearshift_controller_crash_looping_deployments",
            "Deployments whose engine restarted at least CRASH_LOOP_RESTARTS times within "
            "CRASH_LOOP_WINDOW_S, by engine and model (the leader's; 0 on followers).",
            ["engine", "model"], registry=r)
        for kind in MigrationKind:
            self.migrations_started.labels(kind.value)
            for phase in MigrationPhase:
                self.migration_transitions.labels(kind.value, phase.value)
            for result in MIGRATION_RESULTS:
                # present from the start, so increase() sees the first end
                self.migrations_ended.labels(kind.value, result.value)
        self.sla = SlaSignalMetrics(r)  # the SLA signals' block, below

    def decision(self, rule: str, status: Enum | str) -> None:
        """A decision made by `rule` entered `status` (a `DecisionStatus`)."""
        self.decisions.labels(rule or "unknown",
                              status.value if isinstance(status, Enum) else status).inc()

    def migration_created(self, row: MigrationRow) -> None:
        self.migrations_started.labels(row.kind.value).inc()

    def migration_transition(self, row: MigrationRow, _before: MigrationPhase,
                             to: MigrationPhase, _message: str) -> None:
        """Count a stored transition; an ending also counts its result and duration."""
        kind = row.kind.value
        self.migration_transitions.labels(kind, to.value).inc()
        if to.active:
            return
        self.migrations_ended.labels(kind, to.value).inc()
        end = row.finished_at or row.updated_at
        self.migration_seconds.labels(kind, to.value).observe(
            max(0.0, (end - row.created_at).total_seconds()))

    def set_migrations(self, in_flight: dict[tuple[str, str], int],
                       past_deadline: dict[str, int], oldest_age_s: float) -> None:
        """Replace the migration gauges (every active kind and phase is exported, 0 or not)."""
        for kind in MigrationKind:
            for phase in ACTIVE_MIGRATION_PHASES:
                self.migrations_in_flight.labels(kind.value, phase.value).set(
                    in_flight.get((kind.value, phase.value), 0))
        for phase in ACTIVE_MIGRATION_PHASES:
            self.migrations_past_deadline.labels(phase.value).set(past_deadline.get(phase.value, 0))
        self.migration_oldest_age.set(oldest_age_s)

    def set_crash_looping(self, counts: Iterable[tuple[tuple[str, str], int]]) -> None:
        """Replace the crash-loop gauge with (engine, model) -> deployments now looping."""
        self.crash_looping.clear()
        for (engine, model), n in counts:
            self.crash_looping.labels(engine, model).set(n)

    def observe_rollups(self, rows: Iterable[RollupRow]) -> None:
        self.sla.observe(rows)


# --- SLA signals per model and engine (docs/engines.md, "Signals for SLA policies") ---------

class SlaSignalMetrics:
    """The latest complete minute's SLA signals per (model, engine), from the rollups.

    A signal that minute did not have is removed (absent, not 0), so an engine that
    does not export it shows no series. Labels are bounded by the models served.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        labels = ["model", "engine"]
        self.queue_time = Gauge(
            "gearshift_controller_sla_queue_time_seconds",
            "Time requests waited before being scheduled, by quantile (latest minute).",
            [*labels, "quantile"], registry=r)
        self.preemptions = Gauge(
            "gearshift_controller_sla_preemptions_per_second",
            "Requests the engine preempted (or retracted) per second (latest minute).",
            labels, registry=r)
        self.prefix_cache_hit_ratio = Gauge(
            "gearshift_controller_sla_prefix_cache_hit_ratio",
            "Prefix-cache hits over queries, 0..1 (latest minute).", labels, registry=r)
        self.sleeping_replicas = Gauge(
            "gearshift_controller_sla_sleeping_replicas",
            "Deployments whose engine is asleep (latest minute).", labels, registry=r)
        self.request_tokens = Gauge(
            "gearshift_controller_sla_request_tokens_mean",
            "Mean prompt or generated tokens per finished request (latest minute).",
            [*labels, "kind"], registry=r)
        self.kv_blocks = Gauge(
            "gearshift_controller_sla_kv_blocks",
            "KV-cache blocks summed over deployments, total or used (latest minute).",
            [*labels, "state"], registry=r)

    def observe(self, rows: Iterable[RollupRow]) -> None:
        latest: dict[tuple[str, str], RollupRow] = {}
        for row in rows:
            key = (row.model, row.engine)
            if key not in latest or row.minute >= latest[key].minute:
                latest[key] = row
        for (model, engine), row in latest.items():
            self._set(self.queue_time, (model, engine, "0.5"), row.queue_p50_s)
            self._set(self.queue_time, (model, engine, "0.99"), row.queue_p99_s)
            self._set(self.preemptions, (model, engine), row.preemptions_per_s)
            self._set(self.prefix_cache_hit_ratio, (model, engine), row.prefix_cache_hit_rate)
            self.sleeping_replicas.labels(model, engine).set(row.sleeping_replicas)
            self._set(self.request_tokens, (model, engine, "prompt"), row.mean_prompt_tokens)
            self._set(self.request_tokens, (model, engine, "generation"),
                      row.mean_generation_tokens)
            self._set(self.kv_blocks, (model, engine, "total"), row.kv_blocks_total)
            self._set(self.kv_blocks, (model, engine, "used"), row.kv_blocks_used)

    @staticmethod
    def _set(gauge: Gauge, labels: tuple[str, ...], value: float | None) -> None:
        if value is not None:
            gauge.labels(*labels).set(value)
            return
        with suppress(KeyError):  # never set: nothing to remove
            gauge.remove(*labels)
