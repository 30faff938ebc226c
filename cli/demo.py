"""`gearshift demo`: the embedded default, a whole fleet on loopback in under three minutes.

A controller (SQLite), three agents with emulated engines, the gateway and a
load generator, each a real process except the load; the scenario is
`gearshift.devfleet.scenario` (a model moved to TensorRT-LLM through a canary,
one kept on vLLM by revision churn, one whose canary breaks the SLA and rolls
back; with a third engine of the catalog in `--engines` one more that moves from it to
TensorRT-LLM). Decisions and migration steps are printed as they happen; the last line
is `requests: <sent> sent, <failed> failed`, and the exit status is 0 only when
no client request failed.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gearshift.common.engines import ENGINE_NAMES
from gearshift.devfleet.local_fleet import LocalFleet
from gearshift.devfleet.podman_service import EMULATED_IMAGES, PodmanService, configured_ulimits
from gearshift.devfleet.scenario import (
    BASE_ENGINES,
    ModelOutcome,
    outcome,
    run_scenario,
    start_demo_fleet,
)

DEMO_WIDTH_CHARS = 160  # lines wrap at word boundaries here when the output is no terminal


def demo_console(**kwargs: Any) -> Console:
    """The demo's console: lines wrap at word boundaries to the terminal's own width (a
    width wider than the terminal's lets the terminal cut words), or at
    `DEMO_WIDTH_CHARS` into a file or pipe."""
    console = Console(highlight=False, **kwargs)
    if not console.is_terminal and "width" not in kwargs:
        console.width = DEMO_WIDTH_CHARS
    return console


def watch_commands(controller_addr: str) -> list[str]:
    """The CLI commands that look at the running demo fleet, naming its controller."""
    cli = f"gearshift --controller {controller_addr}"
    return [f"{cli} fleet deployments", f"{cli} decisions list",
            f"{cli} migrations list", f"{cli} migrations show ID"]


def print_watch_commands(console: Console, controller_addr: str) -> None:
    console.print("watch the fleet from another terminal while the demo runs:")
    for command in watch_commands(controller_addr):
        # As written (no markup), and never broken by a newline: it is copied and pasted.
        console.print(Text(f"  {command}"), soft_wrap=True)


def _render(rows: list[ModelOutcome], console: Console) -> None:
    table = Table(title="outcome", title_justify="left", header_style="bold")
    for col in ("model", "serving on", "moves", "revision rollouts", "req/s"):
        table.add_column(col)
    for m in rows:
        table.add_row(m.model, ", ".join(m.engines), "; ".join(m.moves) or "-",
                      f"{m.rollouts_done}/{m.rollouts} done" if m.rollouts else "-",
                      f"{m.request_rate:.1f}")
    console.print(table)


def _container_engines(fleet: LocalFleet, console: Console) -> PodmanService:
    """A Podman API service of the demo's own; the agents run every engine from its
    emulated image through it."""
    missing = [i for i in EMULATED_IMAGES.values() if subprocess.run(
        ["podman", "image", "exists", i], capture_output=True).returncode != 0] \
        if shutil.which("podman") else list(EMULATED_IMAGES.values())
    if missing:
        raise click.ClickException(f"--containers needs podman and the images "
                                   f"{', '.join(missing)}: run `make demo "
                                   f"DEMO_ARGS=--containers` (it builds them) or `make "
                                   f"image-engines`")
    service = PodmanService(fleet.workdir / "podman")
    try:
        service.start()
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None
    fleet.containers = {"runtime": "podman", "endpoint": service.url,
                        "ulimits": configured_ulimits()}
    fleet.images = dict(EMULATED_IMAGES)
    console.print(f"engines as containers of {', '.join(EMULATED_IMAGES.values())} "
                  f"(podman API at {service.url})")
    return service


def _remove_engine_containers(fleet: LocalFleet, service: PodmanService) -> None:
    """`gearshift agent drain` for each demo host: no engine container outlives the demo."""
    try:
        for config in sorted(fleet.workdir.glob("*.yaml")):
            if config.name == "demo-policy.yaml":
                continue
            subprocess.run([sys.executable, "-m", "gearshift.cli.main", "agent", "drain",
                            "--config", str(config), "--grace", "5"], capture_output=True,
                           timeout=120)
    finally:
        service.stop()


@click.command()
@click.option("--duration", "duration_s", type=click.FloatRange(30, 3600), default=150.0,
              show_default=True, help="longest run in seconds (it ends earlier once settled)")
@click.option("--workdir", type=click.Path(path_type=Path), default=None,
              help="keep logs and the SQLite store here (default: a temporary folder)")
@click.option("--json-summary", is_flag=True, help="also print the summary as one JSON line")
@click.option("--engines", "engines_csv", default=",".join(BASE_ENGINES), show_default=True,
              help="engines in the scenario, comma-separated: vllm and tensorrt-llm, and one "
                   "more engine of the catalog to add a model that starts there and moves "
                   "to TensorRT-LLM")
@click.option("--containers", is_flag=True,
              help="run the engines as containers of their (emulated) images through "
                   "Podman's API (`make demo DEMO_ARGS=--containers` builds the images)")
def demo(duration_s: float, workdir: Path | None, json_summary: bool, engines_csv: str,
         containers: bool) -> None:
    """Run the embedded default fleet on loopback: decisions and migrations, live."""
    engines = tuple(e.strip() for e in engines_csv.split(",") if e.strip())
    unknown = [e for e in engines if e not in ENGINE_NAMES]
    others = [e for e in ENGINE_NAMES if e not in BASE_ENGINES]
    if unknown or not set(BASE_ENGINES) <= set(engines) or len(set(engines) - set(BASE_ENGINES)) > 1:
        raise click.BadParameter(
            f"expected {' and '.join(BASE_ENGINES)}, optionally one of {', '.join(others)} "
            f"(known engines: {', '.join(ENGINE_NAMES)}), found {engines_csv!r}",
            param_hint="--engines")
    console = demo_console()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gearshift-demo-") as tmp:
        fleet = LocalFleet(workdir or Path(tmp), report_interval_s=1.0)
        service = _container_engines(fleet, console) if containers else None
        try:
            try:
                movers = start_demo_fleet(fleet, console, engines)
            except TimeoutError as exc:
                raise click.ClickException(str(exc)) from None
            print_watch_commands(console, fleet.controller_addr)
            load, watcher = asyncio.run(run_scenario(fleet, duration_s, console, movers))
            rows = outcome(fleet, watcher)
            _render(rows, console)
        finally:
            fleet.stop()
            if service is not None:
                _remove_engine_containers(fleet, service)
    for err in load.errors[:10]:
        console.print(f"[red]failed request[/red]: {err}")
    if json_summary:
        click.echo(json.dumps({"elapsed_s": round(time.monotonic() - t0, 1),
                               "engines": {m.model: ",".join(m.engines) for m in rows},
                               "requests_sent": load.sent, "requests_failed": load.failed}))
    click.echo(f"requests: {load.sent} sent, {load.failed} failed")
    if load.failed:
        raise SystemExit(1)
