"""Every metric the alert rules and the dashboard query is exported by the live processes.

A controller, two agents running the emulator and a gateway, each with its
`--metrics-listen` on loopback; a policy in auto mode moves model `m` from vLLM to
TensorRT-LLM under load through the gateway; then the three kinds of process are
scraped as Prometheus would, the decision and migration series are checked, and every
metric name used by deploy/prometheus/rules.yaml and deploy/grafana/gearshift.json must
be among the names they export (`# TYPE` lines and samples; a histogram's `_bucket`,
`_sum` and `_count` count for it; `up` is Prometheus's own).
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

from promql_names import (
    PROMETHEUS_OWN,
    dashboard_exprs,
    exported,
    metric_names,
    rule_exprs,
)

from gearshift.controller.moves.machine import MigrationKind, MigrationPhase
from gearshift.devfleet.local_fleet import LocalFleet, free_port
from integration.helpers import FAST_ENGINE_ENV, gateway_load, gearshift_json, wait_for
from integration.moves import _apply, _migration_done

CONTROLLER_ARGS = ("--history-resolution", "0.5", "--canary-steps", "0.5",
                   "--analysis-intervals", "2", "--metrics-listen", "127.0.0.1:0")
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)", re.MULTILINE)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def _names(text: str) -> set[str]:
    return set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE)) | {
        m.group(1) for m in SAMPLE.finditer(text)}


def _value(text: str, name: str, **labels: str) -> float | None:
    for m in SAMPLE.finditer(text):
        if m.group(1) == name and all(f'{k}="{v}"' in (m.group(2) or "")
                                      for k, v in labels.items()):
            return float(m.group(3))
    return None


def test_live_processes_export_every_metric_the_alerts_and_dashboard_use(
        fleet: LocalFleet, tmp_path: Path) -> None:
    fleet.start_controller(CONTROLLER_ARGS)
    agent_ports = {"host-a": free_port(), "host-b": free_port()}
    fleet.start_agent("host-a", [{"deployment_id": "m-vllm-0", "model": "m", "engine": "vllm",
                                  "source": "org/m", "revision": "r1", "gpu_indices": [0]}],
                      FAST_ENGINE_ENV,
                      extra_args=("--metrics-listen", f"127.0.0.1:{agent_ports['host-a']}"))
    fleet.start_agent("host-b", [], FAST_ENGINE_ENV,
                      extra_args=("--metrics-listen", f"127.0.0.1:{agent_ports['host-b']}"))
    wait_for(lambda: any(d["report"]["phase"] == "DEPLOYMENT_PHASE_READY"
                         for d in gearshift_json(fleet, "fleet", "deployments")), 60, "m ready")
    fleet.start_gateway()

    with gateway_load(fleet.gateway_url, "m") as load:
        _apply(fleet, tmp_path, "to-trt", "auto", "tensorrt-llm")
        done = wait_for(lambda: _migration_done(fleet, "tensorrt-llm"), 120, "the move to end")
    assert done["phase"] == "done", done
    assert load.failed == 0, load.errors[:5]

    def settled() -> str | None:  # the decision follows its migration; gauges every 5 s
        text = _scrape(fleet.metrics_port)
        ok = (_value(text, "gearshift_controller_decisions_total", rule="prefer-tensorrt-llm",
                     outcome="done") == 1.0
              and _value(text, "gearshift_controller_migration_oldest_age_seconds") == 0.0
              and _value(text, "gearshift_controller_hosts", state="connected") == 2.0)
        return text if ok else None

    controller = wait_for(settled, 30, "the decision done and the gauges refreshed")
    for outcome in ("proposed", "approved", "executing", "done"):
        assert _value(controller, "gearshift_controller_decisions_total",
                      rule="prefer-tensorrt-llm", outcome=outcome) == 1.0, outcome
    assert _value(controller, "gearshift_controller_migrations_started_total",
                  kind="engine_switch") == 1.0
    assert _value(controller, "gearshift_controller_migrations_ended_total",
                  kind="engine_switch", result="done") == 1.0
    assert _value(controller, "gearshift_controller_migrations_ended_total",
                  kind="engine_switch", result="rolled_back") == 0.0
    assert _value(controller, "gearshift_controller_migration_duration_seconds_count",
                  kind="engine_switch", result="done") == 1.0
    assert _value(controller, "gearshift_controller_migration_transitions_total",
                  kind="engine_switch", phase="canary") == 1.0
    in_flight = [float(m.group(3)) for m in SAMPLE.finditer(controller)
                 if m.group(1) == "gearshift_controller_migrations_in_flight"]
    active = [p for p in MigrationPhase if p.active]  # pending, pulling, building, ...
    assert len(in_flight) == len(MigrationKind) * len(active) and not any(in_flight)
    assert _value(controller, "gearshift_controller_migrations_past_deadline",
                  phase="canary") == 0.0
    assert _value(controller, "gearshift_controller_is_leader") == 1.0
    epoch = _value(controller, "gearshift_controller_leader_epoch")
    assert epoch is not None and epoch >= 1
    assert _value(controller, "gearshift_controller_hosts", state="unreachable") == 0.0
    assert (_value(controller, "gearshift_store_flush_seconds_count") or 0) > 0

    gateway = _scrape(fleet.gateway_metrics_port)
    assert (_value(gateway, "gearshift_gateway_requests_total", model="m", code="200") or 0) > 0
    agents = [_scrape(port) for port in agent_ports.values()]
    assert _value(agents[0], "gearshift_agent_connected") == 1.0

    families = _names(controller) | _names(gateway) | set().union(*map(_names, agents))
    used = set().union(*map(metric_names, rule_exprs() + dashboard_exprs())) - PROMETHEUS_OWN
    assert len(used) > 20, used
    missing = sorted(n for n in used if not exported(n, families))
    assert missing == [], f"used by rules or dashboard, exported by no live process: {missing}"
