"""`gearshift fleet status | hosts | deployments | models`."""

from __future__ import annotations

import time

import click

from gearshift.cli.client import call, call_pages, control_stub
from gearshift.cli.output import (
    TABLE_WIDTH_CHARS,
    WIDE_TABLE_WIDTH_CHARS,
    fmt_ms,
    fmt_rate,
    output_option,
    print_json,
    print_table,
    to_dict,
)
from gearshift.common.enum_labels import enum_label
from gearshift.v1 import agent_pb2, control_pb2


def _age(ts_s: float) -> str:
    if ts_s <= 0:
        return "-"
    return f"{max(0.0, time.time() - ts_s):.0f}s ago"


def host_state(v: int) -> str:
    return enum_label(control_pb2.HostState, "HOST_STATE_", v)


def phase(v: int) -> str:
    return enum_label(agent_pb2.DeploymentPhase, "DEPLOYMENT_PHASE_", v)


def phase_cell(r: agent_pb2.DeploymentReport) -> str:
    """The phase; while an image is pulled, with the bytes pulled of the total."""
    name = phase(r.phase)
    if r.phase != agent_pb2.DEPLOYMENT_PHASE_PULLING:
        return name
    if r.pull_bytes_total:
        return (f"{name} {r.pull_bytes_done / r.pull_bytes_total:.0%} "
                f"({r.pull_bytes_done / 1e6:.0f}/{r.pull_bytes_total / 1e6:.0f} MB)")
    return f"{name} {r.pull_bytes_done / 1e6:.0f} MB" if r.pull_bytes_done else name


@click.group()
def fleet() -> None:
    """Hosts, deployments and models as the controller sees them."""


@fleet.command()
@output_option
@click.pass_context
def status(ctx: click.Context, output: str) -> None:
    """One-screen summary of the fleet."""
    with control_stub(ctx) as stub:
        resp = call(stub.FleetStatus, control_pb2.FleetStatusRequest())
    if output == "json":
        print_json(to_dict(resp))
        return
    rows = [
        ("controller", f"{resp.controller_id} (epoch {resp.epoch}, store {resp.store})"),
        ("hosts", f"{resp.hosts} ({resp.hosts_connected} connected, "
                  f"{resp.hosts_unreachable} unreachable)"),
        ("gpus", resp.gpus),
        ("deployments", f"{resp.deployments} ({resp.deployments_ready} ready)"),
        ("models", resp.models),
        ("request rate", f"{resp.request_rate:.1f} req/s"),
        ("reports", resp.reports_total),
        ("automation", "paused" if resp.paused else "running"),
    ]
    print_table("fleet", ["", "value"], rows)


def engine_label(engine: str, version: str, release: str, match: int) -> str:
    """"vllm 0.11.2", or, for a version the agent's version table does not know, the row
    it runs with: "vllm 0.40.0 [as 0.18: outside the version table]"."""
    if match == agent_pb2.VERSION_MATCH_NEAREST:
        return f"{engine} {version} [as {release}: outside the version table]"
    if match == agent_pb2.VERSION_MATCH_UNKNOWN:
        return f"{engine} ? [as {release}: version unknown]"
    return f"{engine} {version}".strip()


@fleet.command()
@output_option
@click.pass_context
def hosts(ctx: click.Context, output: str) -> None:
    """Hosts with their GPUs, engines and liveness."""
    with control_stub(ctx) as stub:
        resp = call_pages(stub.ListHosts, control_pb2.ListHostsRequest(), "hosts")
    if output == "json":
        print_json([to_dict(h) for h in resp.hosts])
        return
    rows = []
    for h in resp.hosts:
        models = sorted({g.model for g in h.gpus})
        gpus = f"{len(h.gpus)} x {', '.join(models)}" if h.gpus else "0"
        if h.emulated_gpus:
            gpus += " (emulated)"
        unhealthy = sum(1 for g in h.gpus if g.health in (agent_pb2.GPU_HEALTH_DEGRADED,
                                                           agent_pb2.GPU_HEALTH_FAILED))
        engines = ", ".join(engine_label(e.engine, e.version, e.release, e.version_match)
                            for e in h.engines)
        rows.append((h.host_id, host_state(h.state), gpus, unhealthy, engines, h.deployments,
                     _age(h.last_report.ToNanoseconds() / 1e9),
                     ",".join(f"{k}={v}" for k, v in sorted(h.labels.items()))))
    print_table("hosts", ["host", "state", "gpus", "gpu issues", "engines", "deployments",
                          "last report", "labels"], rows)


@fleet.command()
@click.option("--model", default="", help="only this model")
@click.option("--host", "host_id", default="", help="only this host")
@click.option("-o", "--output", type=click.Choice(["table", "wide", "json"]), default="table",
              show_default=True,
              help="table for people, wide adds the SLA signals, json for tools")
@click.pass_context
def deployments(ctx: click.Context, model: str, host_id: str, output: str) -> None:
    """Deployments with live figures from the engines' own metrics (-o wide: also queue
    time, preemptions, prefix-cache hit rate, sleep state, request lengths, KV blocks)."""
    with control_stub(ctx) as stub:
        resp = call_pages(stub.ListDeployments,
                          control_pb2.ListDeploymentsRequest(model=model, host_id=host_id),
                          "deployments")
    if output == "json":
        print_json([to_dict(d) for d in resp.deployments])
        return
    columns = ["deployment", "host", "model", "engine", "rev", "phase", "req/s", "run/wait",
               "ttft p50 ms", "ttft p99 ms", "itl p99 ms", "tok/s", "kv", "restarts", "endpoint"]
    rows: list[tuple[object, ...]] = []
    for d in resp.deployments:
        r = d.report
        row: tuple[object, ...] = (
            r.deployment_id, d.host_id, r.model,
            engine_label(r.engine, r.engine_version, r.engine_release, r.engine_version_match),
            r.revision or "-", phase_cell(r), fmt_rate(r.request_rate),
            f"{r.running_requests:.0f}/{r.waiting_requests:.0f}",
            fmt_ms(r.ttft.p50_s, r.ttft.present), fmt_ms(r.ttft.p99_s, r.ttft.present),
            fmt_ms(r.itl.p99_s, r.itl.present), f"{r.generation_tokens_per_s:.0f}",
            f"{r.kv_cache_usage * 100:.0f}%", r.restarts, r.endpoint)
        rows.append(row + sla_cells(r) if output == "wide" else row)
    if output == "wide":
        columns += list(SLA_COLUMNS)
    print_table("deployments", columns, rows,
                width=WIDE_TABLE_WIDTH_CHARS if output == "wide" else TABLE_WIDTH_CHARS)


SLA_COLUMNS = ("queue p50 ms", "queue p99 ms", "preempt/s", "prefix hit", "sleep",
               "prompt tok", "gen tok", "kv blocks")


def sla_cells(r: agent_pb2.DeploymentReport) -> tuple[str, ...]:
    """The SLA signals of one report, "-" where the engine does not export one."""
    def opt(name: str, fmt: str) -> str:
        return format(getattr(r, name), fmt) if r.HasField(name) else "-"
    hit = f"{r.prefix_cache_hit_rate * 100:.0f}%" if r.HasField("prefix_cache_hit_rate") else "-"
    sleep = ("-" if r.sleep_state == agent_pb2.ENGINE_SLEEP_STATE_UNSPECIFIED
             else enum_label(agent_pb2.EngineSleepState, "ENGINE_SLEEP_STATE_", r.sleep_state))
    used = str(r.kv_blocks_used) if r.HasField("kv_blocks_used") else "-"
    blocks = f"{used}/{r.kv_blocks_total}" if r.HasField("kv_blocks_total") else "-"
    return (fmt_ms(r.queue_time.p50_s, r.queue_time.present),
            fmt_ms(r.queue_time.p99_s, r.queue_time.present), opt("preemptions_per_s", ".2f"),
            hit, sleep, opt("mean_prompt_tokens", ".0f"), opt("mean_generation_tokens", ".0f"),
            blocks)


@fleet.command()
@output_option
@click.pass_context
def models(ctx: click.Context, output: str) -> None:
    """Models: which engines serve them, traffic and worst latency."""
    with control_stub(ctx) as stub:
        resp = call_pages(stub.ListModels, control_pb2.ListModelsRequest(), "models")
    if output == "json":
        print_json([to_dict(m) for m in resp.models])
        return
    rows = [(m.model, ", ".join(m.engines), f"{m.ready}/{m.deployments}", fmt_rate(m.request_rate),
             fmt_ms(m.ttft_p99_s, m.latency_present), fmt_ms(m.itl_p99_s, m.latency_present),
             ", ".join(m.revisions) or "-") for m in resp.models]
    print_table("models", ["model", "engines", "ready", "req/s", "ttft p99 ms", "itl p99 ms",
                           "revisions"], rows)
