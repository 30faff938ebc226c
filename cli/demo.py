"""`gearshift demo`: the embedded default fleet on loopback, shown live.

A controller (SQLite in a temporary folder) and agents with emulated engines,
each a real process; a light load generator sends requests to the engines so
the figures move; the fleet table refreshes until `--duration` ends it.
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import aiohttp
import click
import grpc
from rich.console import Console
from rich.live import Live
from rich.table import Table

from gearshift.cli.fleet import host_state, phase
from gearshift.cli.local_fleet import LocalFleet
from gearshift.v1 import control_pb2, control_pb2_grpc

DEMO_DEPLOYMENTS = {
    "host-a": [
        {"deployment_id": "llama-70b-vllm-a", "model": "llama-3.3-70b", "engine": "vllm",
         "source": "meta-llama/Llama-3.3-70B-Instruct", "revision": "r1",
         "tensor_parallel_size": 4, "gpu_indices": [0, 1, 2, 3]},
    ],
    "host-b": [
        {"deployment_id": "qwen-8b-trt-b", "model": "qwen3-8b", "engine": "tensorrt-llm",
         "backend": "pytorch", "source": "Qwen/Qwen3-8B", "revision": "r7",
         "tensor_parallel_size": 1, "gpu_indices": [0]},
        {"deployment_id": "mistral-7b-vllm-b", "model": "mistral-7b", "engine": "vllm",
         "source": "mistralai/Mistral-7B-Instruct-v0.3", "revision": "r3",
         "tensor_parallel_size": 1, "gpu_indices": [1]},
    ],
}
LOAD_RPS = {"llama-3.3-70b": 12.0, "qwen3-8b": 25.0, "mistral-7b": 6.0}


def _fleet_table(deps: control_pb2.ListDeploymentsResponse, hosts: control_pb2.ListHostsResponse,
                 elapsed_s: float, sent: int, failed: int) -> Table:
    table = Table(title=f"gearshift demo — {elapsed_s:.0f}s — requests: {sent} sent, {failed} failed",
                  title_justify="left", header_style="bold")
    for col in ("host", "state", "deployment", "model", "engine", "phase", "req/s", "ttft p99 ms",
                "itl p99 ms", "kv", "restarts"):
        table.add_column(col)
    states = {h.host_id: host_state(h.state) for h in hosts.hosts}
    for d in deps.deployments:
        r = d.report
        table.add_row(d.host_id, states.get(d.host_id, "?"), r.deployment_id, r.model, r.engine,
                      phase(r.phase), f"{r.request_rate:.1f}",
                      f"{r.ttft.p99_s * 1000:.0f}" if r.ttft.present else "-",
                      f"{r.itl.p99_s * 1000:.1f}" if r.itl.present else "-",
                      f"{r.kv_cache_usage * 100:.0f}%", str(r.restarts))
    return table


class LoadGenerator:
    """Poisson arrivals per model, sent through the gateway as a client would."""

    def __init__(self, gateway_url: str, rates: dict[str, float]) -> None:
        self.gateway_url = gateway_url
        self.rates = rates
        self.sent = 0
        self.failed = 0

    async def run(self, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession() as session:
            tasks = [asyncio.create_task(self._model_loop(session, m, r, stop))
                     for m, r in self.rates.items()]
            await asyncio.gather(*tasks)

    async def _model_loop(self, session: aiohttp.ClientSession, model: str, rps: float,
                          stop: asyncio.Event) -> None:
        inflight: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            await asyncio.sleep(random.expovariate(rps))
            t = asyncio.create_task(self._one(session, model))
            inflight.add(t)
            t.add_done_callback(inflight.discard)
        await asyncio.gather(*inflight, return_exceptions=True)

    async def _one(self, session: aiohttp.ClientSession, model: str) -> None:
        self.sent += 1
        body = {"model": model, "prompt": "Explain continuous batching.", "max_tokens": 16}
        try:
            async with session.post(f"{self.gateway_url}/v1/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=30)) as resp:
                await resp.read()
                if resp.status != 200:
                    self.failed += 1
        except (aiohttp.ClientError, TimeoutError):
            self.failed += 1


async def _run(fleet: LocalFleet, duration_s: float, console: Console, live: bool) -> tuple[int, int]:
    load = LoadGenerator(fleet.gateway_url, LOAD_RPS)
    stop = asyncio.Event()
    load_task = asyncio.create_task(load.run(stop))
    started = time.monotonic()
    async with grpc.aio.insecure_channel(fleet.controller_addr) as channel:
        stub = control_pb2_grpc.ControlServiceStub(channel)
        with Live(console=console, auto_refresh=False, transient=False) if live else _NoLive() as view:
            while (elapsed := time.monotonic() - started) < duration_s:
                deps = await stub.ListDeployments(control_pb2.ListDeploymentsRequest(), timeout=5)
                hosts = await stub.ListHosts(control_pb2.ListHostsRequest(), timeout=5)
                table = _fleet_table(deps, hosts, elapsed, load.sent, load.failed)
                if live:
                    view.update(table, refresh=True)
                elif int(elapsed) % 10 == 0:
                    console.print(table)
                await asyncio.sleep(1.0)
    stop.set()
    await load_task
    return load.sent, load.failed


def _wait_ready(fleet: LocalFleet, n: int, timeout_s: float = 60.0) -> None:
    """Wait until every demo deployment is ready and routed, so no request meets an empty table."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(fleet.controller_addr) as channel:
        stub = control_pb2_grpc.ControlServiceStub(channel)
        while time.monotonic() < deadline:
            deps = stub.ListDeployments(control_pb2.ListDeploymentsRequest(), timeout=5)
            if sum(1 for d in deps.deployments if phase(d.report.phase) == "ready") >= n:
                time.sleep(0.5)  # one routing-table push to the gateway
                return
            time.sleep(0.2)
    raise click.ClickException(f"the demo deployments were not ready within {timeout_s:.0f}s")


class _NoLive:
    def __enter__(self) -> _NoLive:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, *args: object, **kwargs: object) -> None:
        return None


@click.command()
@click.option("--duration", "duration_s", type=float, default=60.0, show_default=True,
              help="seconds to run before a clean shutdown")
@click.option("--workdir", type=click.Path(path_type=Path), default=None,
              help="keep logs and the SQLite store here (default: a temporary folder)")
@click.option("--json-summary", is_flag=True, help="print the final summary as JSON")
def demo(duration_s: float, workdir: Path | None, json_summary: bool) -> None:
    """Run the embedded default fleet on loopback and show it live."""
    console = Console(width=160)
    with tempfile.TemporaryDirectory(prefix="gearshift-demo-") as tmp:
        fleet = LocalFleet(workdir or Path(tmp), report_interval_s=1.0)
        try:
            fleet.start_controller()
            console.print(f"controller on {fleet.controller_addr}, metrics on :{fleet.metrics_port}")
            for host_id, deps in DEMO_DEPLOYMENTS.items():
                fleet.start_agent(host_id, deps)
            fleet.start_gateway()
            console.print(f"gateway on {fleet.gateway_url} (OpenAI-compatible)")
            _wait_ready(fleet, sum(len(d) for d in DEMO_DEPLOYMENTS.values()))
            sent, failed = asyncio.run(_run(fleet, duration_s, console, console.is_terminal))
        finally:
            fleet.stop()
    summary = {"duration_s": duration_s, "requests_sent": sent, "requests_failed": failed}
    if json_summary:
        click.echo(json.dumps(summary))
    click.echo(f"requests: {sent} sent, {failed} failed")
    if failed:
        raise SystemExit(1)
