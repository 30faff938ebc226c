"""`gearshift decisions list | explain | approve | reject | evaluate`, `gearshift pause | resume`.

Decisions are made by the controller's policy loop (docs/decisions.md); these commands
read them, explain them (rendered by `explain`), and let a person approve or
reject them in `approve` mode. `pause` stops automatic action fleet-wide;
`resume` starts it again.
"""

from __future__ import annotations

from collections.abc import Sequence

import click

from gearshift.cli.client import call, control_stub
from gearshift.cli.explain import decision_report, expected_saving_per_day, fmt_time
from gearshift.cli.output import output_option, print_json, print_table, to_dict
from gearshift.cli.policy_remote import operator_id
from gearshift.policies.core import DecisionStatus
from gearshift.v1 import control_pb2

DEFAULT_LIST_LIMIT = 50
MAX_LIST_LIMIT = 10_000
NO_DECISION_INLINE = 3  # `decisions evaluate`: up to this many reasons on the summary line
NO_DECISION_LINES = 50  # …and at most this many listed

reason_required = click.option("--reason", required=True, help="why; kept with the decision")


def print_decisions(title: str, decisions: Sequence[control_pb2.Decision]) -> None:
    rows = [(d.id, fmt_time(d.created_at), d.model, f"{d.from_engine} → {d.to_engine}", d.rule,
             d.status, expected_saving_per_day(d)) for d in decisions]
    print_table(title, ["id", "created", "model", "from → to", "rule", "status",
                        "saving/day"], rows)


@click.group("decisions")
def decisions() -> None:
    """What the policy decided, why, and approval of proposed moves."""


@decisions.command("list")
@click.option("--model", default="", help="only this model")
@click.option("--status", default="", type=click.Choice(["", *(s.value for s in DecisionStatus)]),
              help="only decisions in this status")
@click.option("--limit", default=DEFAULT_LIST_LIMIT, show_default=True,
              type=click.IntRange(1, MAX_LIST_LIMIT), help="newest N decisions")
@output_option
@click.pass_context
def list_(ctx: click.Context, model: str, status: str, limit: int, output: str) -> None:
    """Decisions, newest first."""
    with control_stub(ctx) as stub:
        resp = call(stub.ListDecisions,
                    control_pb2.ListDecisionsRequest(model=model, status=status, limit=limit))
    if output == "json":
        print_json([to_dict(d) for d in resp.decisions])
    elif not resp.decisions:
        click.echo("no decisions" + (" matching the filters" if model or status else " yet"))
    else:
        print_decisions("decisions", resp.decisions)


@decisions.command("explain")
@click.argument("decision_id", metavar="ID")
@output_option
@click.pass_context
def explain(ctx: click.Context, decision_id: str, output: str) -> None:
    """Why decision ID was taken, what it should change, and what would reverse it."""
    with control_stub(ctx) as stub:
        d = call(stub.GetDecision, control_pb2.GetDecisionRequest(id=decision_id))
    if output == "json":
        print_json(to_dict(d))
    else:
        click.echo(decision_report(d))


def _review(ctx: click.Context, approve: bool, decision_id: str, reason: str, output: str) -> None:
    req = control_pb2.ReviewDecisionRequest(id=decision_id, reason=reason, by=operator_id())
    with control_stub(ctx) as stub:
        d = call(stub.ApproveDecision if approve else stub.RejectDecision, req)
    if output == "json":
        print_json(to_dict(d))
        return
    click.echo(f"{'approved' if approve else 'rejected'} {d.id}: move {d.model} "
               f"from {d.from_engine} to {d.to_engine}, now {d.status}")


@decisions.command("approve")
@click.argument("decision_id", metavar="ID")
@click.option("--reason", default="", help="why; kept with the decision")
@output_option
@click.pass_context
def approve(ctx: click.Context, decision_id: str, reason: str, output: str) -> None:
    """Approve proposed decision ID so the controller carries it out."""
    _review(ctx, True, decision_id, reason, output)


@decisions.command("reject")
@click.argument("decision_id", metavar="ID")
@reason_required
@output_option
@click.pass_context
def reject(ctx: click.Context, decision_id: str, reason: str, output: str) -> None:
    """Reject proposed decision ID (a reason is required)."""
    if not reason.strip():
        raise click.UsageError("--reason: give a non-empty reason for rejecting")
    _review(ctx, False, decision_id, reason, output)


@decisions.command("evaluate")
@output_option
@click.pass_context
def evaluate(ctx: click.Context, output: str) -> None:
    """Run the policy loop once now: the decisions it made, and why other models got none."""
    with control_stub(ctx) as stub:
        resp = call(stub.EvaluateNow, control_pb2.EvaluateNowRequest())
    if output == "json":
        print_json(to_dict(resp))
        return
    click.echo(evaluate_summary(resp))
    if resp.decisions:
        print_decisions("new decisions", resp.decisions)


def evaluate_summary(resp: control_pb2.EvaluateNowResponse) -> str:
    """The controller's message, then each model that got no decision and why: on the same
    line for a few, a line each beyond, the first `NO_DECISION_LINES` (`-o json`: all)."""
    head = resp.message or ("no new decisions" if not resp.decisions else "")
    held = resp.no_decision
    if not held:
        return head
    lead = f"{head}; " if head else ""
    lead += f"no decision for {len(held)} model(s):"
    items = [f"{h.model}: {h.detail}" for h in held[:NO_DECISION_LINES]]
    if len(held) > NO_DECISION_LINES:
        items.append(f"… and {len(held) - NO_DECISION_LINES} more (-o json lists them all)")
    if len(held) <= NO_DECISION_INLINE:
        return f"{lead} {'; '.join(items)}"
    return "\n".join([lead, *(f"  {i}" for i in items)])


def _set_paused(ctx: click.Context, paused: bool, reason: str, output: str) -> None:
    with control_stub(ctx) as stub:
        resp = call(stub.SetPaused, control_pb2.SetPausedRequest(paused=paused, reason=reason))
    if output == "json":
        print_json(to_dict(resp))
    elif resp.paused:
        click.echo("automation paused: the controller starts no new moves until "
                   "`gearshift resume`")
    else:
        click.echo("automation running: the controller acts on its policy again")


@click.command("pause")
@click.option("--reason", default="", help="why; shown to other operators")
@output_option
@click.pass_context
def pause(ctx: click.Context, reason: str, output: str) -> None:
    """Stop automatic moves fleet-wide until `gearshift resume`."""
    _set_paused(ctx, True, reason, output)


@click.command("resume")
@output_option
@click.pass_context
def resume(ctx: click.Context, output: str) -> None:
    """Resume automatic moves after `gearshift pause`."""
    _set_paused(ctx, False, "", output)
