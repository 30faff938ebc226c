"""`gearshift migrations list | show | abort` and `gearshift models publish`.

(`models capacity` and `models forecast` are in `gearshift.cli.learning`.)

Migrations are the controller's durable state machines that carry out a move or
a revision rollout (docs/migrations.md); `show` renders the step log through `explain`.
"""

from __future__ import annotations

import click

from gearshift.cli.client import call, control_stub
from gearshift.cli.explain import (
    fmt_time,
    migration_move,
    migration_phase,
    migration_report,
)
from gearshift.cli.lazy_group import LazyCommand, LazyGroup
from gearshift.cli.output import output_option, print_json, print_table, to_dict
from gearshift.v1 import control_pb2

# The phases in which a migration has ended (controller/moves/machine.py TERMINAL_PHASES):
# only these have a `finished_at`.

# What was learned about a model: these need the learning stack (numpy, scikit-learn),
# so `gearshift.cli.learning` is imported only when one of them runs.
LEARNING_COMMANDS = {
    "capacity": LazyCommand(
        "gearshift.cli.learning:capacity",
        "Learned capacity at the SLA per engine (with its uncertainty band)."),
    "forecast": LazyCommand(
        "gearshift.cli.learning:forecast",
        "Forecast of the sustained (low quantile) and peak request rate over the horizon."),
}

@click.group("migrations")
def migrations() -> None:
    """Moves and rollouts in flight and done, step by step."""


@migrations.command("list")
@click.option("--active", is_flag=True, help="only migrations that have not finished")
@click.option("--model", default="", help="only this model")
@output_option
@click.pass_context
def list_(ctx: click.Context, active: bool, model: str, output: str) -> None:
    """Migrations, with their phase and what each waits for."""
    with control_stub(ctx) as stub:
        resp = call(stub.ListMigrations,
                    control_pb2.ListMigrationsRequest(active_only=active, model=model))
    if output == "json":
        print_json([to_dict(m) for m in resp.migrations])
        return
    if not resp.migrations:
        click.echo(("no active migrations" if active else "no migrations")
                   + (f" for {model}" if model else ""))
        return
    rows = [(m.id, m.model, migration_move(m), m.kind, migration_phase(m),
             fmt_time(m.created_at), m.status_message or m.reason or "-") for m in resp.migrations]
    print_table("migrations", ["id", "model", "change", "kind", "phase", "created",
                               "status"], rows)


def show_report(m: control_pb2.Migration) -> str:
    """`migrations show`: the explain report (its times line holds only the times the
    migration has)."""
    return migration_report(m)


@migrations.command("show")
@click.argument("migration_id", metavar="ID")
@output_option
@click.pass_context
def show(ctx: click.Context, migration_id: str, output: str) -> None:
    """One migration: where it stands and its step log with canary figures."""
    with control_stub(ctx) as stub:
        m = call(stub.GetMigration, control_pb2.GetMigrationRequest(id=migration_id))
    if output == "json":
        print_json(to_dict(m))
    else:
        click.echo(show_report(m))


@migrations.command("abort")
@click.argument("migration_id", metavar="ID")
@click.option("--reason", required=True, help="why; kept with the migration")
@output_option
@click.pass_context
def abort(ctx: click.Context, migration_id: str, reason: str, output: str) -> None:
    """Abort migration ID: it rolls back to the source (a reason is required)."""
    if not reason.strip():
        raise click.UsageError("--reason: give a non-empty reason for aborting")
    with control_stub(ctx) as stub:
        m = call(stub.AbortMigration,
                 control_pb2.AbortMigrationRequest(id=migration_id, reason=reason))
    if output == "json":
        print_json(to_dict(m))
    else:
        click.echo(f"aborting {m.id}: {m.model} now {migration_phase(m)}")


@click.group("models", cls=LazyGroup, lazy_subcommands=LEARNING_COMMANDS)
def models() -> None:
    """Model revisions: publish new weights and roll them out."""


@models.command("publish")
@click.argument("name")
@click.option("--revision", required=True, help="the new revision (e.g. a commit or tag)")
@click.option("--source", default="", metavar="PATH",
              help="where the engines load the revision from (as the hosts see it)")
@output_option
@click.pass_context
def publish(ctx: click.Context, name: str, revision: str, source: str, output: str) -> None:
    """Publish revision R of model NAME; the controller rolls it out as a migration."""
    if not revision.strip():
        raise click.UsageError("--revision: give a non-empty revision")
    with control_stub(ctx) as stub:
        resp = call(stub.PublishRevision,
                    control_pb2.PublishRevisionRequest(model=name, revision=revision, source=source))
    if output == "json":
        print_json(to_dict(resp))
        return
    if resp.migration.id:
        click.echo(f"started migration {resp.migration.id}: {name} to revision {revision} "
                   f"({migration_phase(resp.migration)})")
    if resp.message:
        click.echo(resp.message)
    if not resp.migration.id and not resp.message:
        click.echo(f"published {name} revision {revision}")
