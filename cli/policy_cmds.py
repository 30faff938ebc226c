"""`gearshift policy …` commands that need no controller: validate, schema, backtest.

The controller-backed commands (apply, show, diff, history) live in
`gearshift.cli.policy_remote`; the group imports that module (and gRPC) only when
one of them runs. The backtest's numeric stack is imported by `backtest` alone.
Importing this module has no side effects.
"""

from __future__ import annotations

import gc
import json
from typing import TYPE_CHECKING, Any

import click

from gearshift.cli.lazy_group import LazyCommand, LazyGroup
from gearshift.common.errors import GearshiftError
from gearshift.policies.loader import Policy, load_policy_file, policy_json_schema

if TYPE_CHECKING:
    from gearshift.policies.core import Decision
    from gearshift.v1 import control_pb2

# The collector's young-generation threshold while a backtest runs (CPython's: 700).
BACKTEST_GC_YOUNG = 5000

REMOTE_COMMANDS = {
    "apply": LazyCommand(
        "gearshift.cli.policy_remote:apply",
        "Apply the policy in FILE on the controller, or restore --version N."),
    "diff": LazyCommand(
        "gearshift.cli.policy_remote:diff",
        "Unified diff from the active policy (or version N) to FILE."),
    "history": LazyCommand(
        "gearshift.cli.policy_remote:history",
        "Every applied policy version, the active one marked with *."),
    "show": LazyCommand(
        "gearshift.cli.policy_remote:show",
        "Print the active policy (or version N) as applied, after a comment header."),
}


def _load(path: str) -> Policy:
    try:
        return load_policy_file(path)
    except GearshiftError as exc:
        raise click.ClickException(exc.message) from None


@click.group("policy", cls=LazyGroup, lazy_subcommands=REMOTE_COMMANDS)
def policy() -> None:
    """Write, check and replay engine policies."""


def echo_warnings(warnings: list[str] | tuple[str, ...]) -> None:
    for w in warnings:
        click.echo(f"warning: {w}", err=True)


@policy.command("validate")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--strict", is_flag=True, default=False,
              help="Treat warnings (conditions that never hold, NaN, no engine left) as errors.")
def validate(files: tuple[str, ...], strict: bool) -> None:
    """Check policy FILES; print each one's version, or every problem found."""
    problems: list[str] = []
    for path in files:
        try:
            p = load_policy_file(path, strict=strict)
        except GearshiftError as exc:
            problems.append(exc.message)
            continue
        echo_warnings(p.warnings)
        click.echo(f"{path}: ok ({p.version}, mode {p.mode}, {len(p.doc.spec.rules)} rules"
                   f"{f', {len(p.warnings)} warnings' if p.warnings else ''})")
        for line in p.deprecations:
            click.echo(f"warning: {line}", err=True)
    if problems:
        raise click.ClickException("\n".join(problems))


@policy.command("schema")
def schema() -> None:
    """Print the JSON Schema of an EnginePolicy document."""
    click.echo(json.dumps(policy_json_schema(), indent=2, sort_keys=True))


@policy.command("backtest")
@click.argument("policy_file", metavar="POLICY", type=click.Path(dir_okay=False))
@click.option("--trace", "trace_file", required=True, type=click.Path(dir_okay=False),
              help="Trace file (JSON Lines, optionally gzipped; docs/cost-model.md).")
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text",
              show_default=True)
@click.option("--compare", "compare_file", type=click.Path(dir_okay=False), default=None,
              help="Another policy: show where it decides differently and what that costs.")
@click.option("--blind", is_flag=True, default=False,
              help="Hide the header's capacities and latencies from the policy: it learns "
                   "capacity from simulated latency observations of the serving engine.")
@click.option("--explain", is_flag=True, default=False,
              help="Also explain every switch as `decisions explain` does (JSON: a "
                   "\"decisions\" key, per model, with each decision's inputs).")
def backtest(policy_file: str, trace_file: str, output: str, compare_file: str | None,
             blind: bool, explain: bool) -> None:
    """Replay a trace through POLICY and price the outcome."""
    from gearshift.policies.backtest import run_backtest
    from gearshift.policies.trace import read_trace

    pol = _load(policy_file)
    other = _load(compare_file) if compare_file else None
    try:
        trace = read_trace(trace_file)
    except GearshiftError as exc:
        raise click.ClickException(exc.message) from None
    # A replay allocates many short-lived objects and keeps the trace's: while it runs,
    # the collector leaves what start-up and the trace made alone (`gc.freeze`) and runs
    # its young collections less often (in a blind backtest of bench/blind.py's fleet its
    # time went from 0.39 to 0.12 s). The settings are put back after (the command may
    # run in-process): the threshold, and the freeze only where nothing was frozen before
    # (another owner's frozen objects stay as they were).
    saved = gc.get_threshold()
    freezing = gc.get_freeze_count() == 0
    if freezing:
        gc.freeze()
    gc.set_threshold(BACKTEST_GC_YOUNG, *saved[1:])
    try:
        result = run_backtest(pol, trace, compare=other, blind=blind, decisions=explain)
    except GearshiftError as exc:  # e.g. figures the cost model cannot price exactly
        raise click.ClickException(exc.message) from None
    finally:
        gc.set_threshold(*saved)
        if freezing:
            gc.unfreeze()
    decided = result.pop("decisions", None)
    if output == "json":
        if decided is not None:
            result["decisions"] = {m: [d.to_dict() for d in ds] for m, ds in decided.items()}
        click.echo(json.dumps(result))
        return
    if blind:
        click.echo("blind run: capacities learned from simulated latency, not read from the trace")
    _print_text(result)
    if decided is not None:
        from gearshift.cli.explain import decision_report

        for ds in decided.values():
            for d in ds:
                click.echo("\n" + decision_report(_decision_msg(d)))


def _decision_msg(d: Decision) -> control_pb2.Decision:
    """A backtest's decision as the controller stores it, for `decision_report`."""
    from google.protobuf import json_format

    from gearshift.common.json_values import finite_json
    from gearshift.v1 import control_pb2

    row = d.to_dict()
    msg = control_pb2.Decision(
        id=f"backtest-{d.model}-{row['created_at']}", model=d.model, from_engine=d.from_engine,
        to_engine=d.to_engine, rule=d.rule, reason=d.reason, mode="backtest",
        status="backtest")
    for key in ("inputs", "expected", "alternatives"):
        json_format.ParseDict(finite_json(row[key]), getattr(msg, key))
    for c in row["conditions"]:
        json_format.ParseDict(finite_json(c), msg.conditions.add(), ignore_unknown_fields=True)
    if d.trial_share is not None:
        msg.trial_share = d.trial_share
    msg.created_at.FromSeconds(int(d.created_at))
    return msg



def _usd(v: float) -> str:
    return f"${v:,.2f}"


def _print_text(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    s, b = r["summary"], r["baselines"]
    console.print(f"[bold]{r['policy']}[/bold] on trace [bold]{r['trace']}[/bold]: "
                  f"{_usd(s['cost_usd'])}, {s['flaps']} flaps, revision lag {s['revision_lag_h']} h, "
                  f"SLA violations {s['sla_violation_min']} min")
    console.print("baselines: " + ", ".join(f"{name} {_usd(v['cost_usd'])}"
                                            for name, v in b.items()))
    table = Table("model", "cost", "GPU-h", "flaps", "rev. lag h", "SLA min", "switches")
    for name, m in r["models"].items():
        switches = ", ".join(f"{w['ts']} → {w['to']} ({w['rule']})" for w in m["switches"]) or "-"
        table.add_row(name, _usd(m["cost_usd"]), f"{m['gpu_hours']:,.2f}", str(m["flaps"]),
                      str(m["revision_lag_h"]), str(m["sla_violation_min"]), switches)
    console.print(table)
    c = r.get("compare")
    if c is None:
        return
    delta = c["cost_delta_usd"]
    console.print(f"\ncompared with [bold]{c['policy']}[/bold]: {_usd(c['summary']['cost_usd'])} "
                  f"({'+' if delta >= 0 else '-'}{_usd(abs(delta))} vs {r['policy']}), "
                  f"{c['summary']['flaps']} flaps")
    diff = Table("model", f"only {r['policy']}", f"only {c['policy']}", "cost difference")
    for name, m in c["models"].items():
        if not m["only_policy"] and not m["only_other"] and not m["cost_delta_usd"]:
            continue
        diff.add_row(name, "\n".join(f"{w['ts']} → {w['to']}" for w in m["only_policy"]) or "-",
                     "\n".join(f"{w['ts']} → {w['to']}" for w in m["only_other"]) or "-",
                     f"{'+' if m['cost_delta_usd'] >= 0 else '-'}{_usd(abs(m['cost_delta_usd']))}")
    if diff.row_count:
        console.print(diff)
    else:
        console.print("both policies decide the same on every model")
