"""The `gearshift` command: one root group; each area registers its commands here."""

from __future__ import annotations

import click

from gearshift.agents.emulator.cli import emulate
from gearshift.cli import learning as _learning  # noqa: F401  (adds models capacity/forecast)
from gearshift.cli import policy_remote as _policy_remote  # noqa: F401  (adds apply/show/diff/history)
from gearshift.cli.certs import certs
from gearshift.cli.daemons import agent, controller
from gearshift.cli.decisions import decisions, pause, resume
from gearshift.cli.demo import demo
from gearshift.cli.fleet import fleet
from gearshift.cli.migrations import migrations, models
from gearshift.cli.policy_cmds import policy
from gearshift.gateway.cli import gateway


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--controller", "controller_addr", default=None, envvar="GEARSHIFT_CONTROLLER",
              metavar="HOST:PORT", help="controller address (default 127.0.0.1:50051)")
@click.pass_context
def cli(ctx: click.Context, controller_addr: str | None) -> None:
    """gearshift: adaptive engine selection for LLM serving on vLLM and TensorRT-LLM."""
    ctx.obj = {"controller": controller_addr}


cli.add_command(controller)
cli.add_command(agent)
cli.add_command(fleet)
cli.add_command(gateway)
cli.add_command(emulate)
cli.add_command(demo)
cli.add_command(policy)
for _cmd in (decisions, pause, resume, migrations, models, certs):
    cli.add_command(_cmd)


def main() -> None:
    cli(prog_name="gearshift")


if __name__ == "__main__":
    main()
