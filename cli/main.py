"""The `gearshift` command: one root group; each area registers its commands here.

Commands are registered by name and imported only when they run (`LazyGroup`), so
`gearshift --help` and a command that needs neither the controller nor the learning
stack start without importing them. A new command gets a line in `COMMANDS`, with
the first line of its docstring as the short help (a test keeps the two equal).
"""

from __future__ import annotations

import inspect

import click

from gearshift.cli.lazy_group import LazyCommand, LazyGroup

COMMANDS = {
    "agent": LazyCommand(
        "gearshift.cli.daemons:agent",
        "Run the agent on a GPU host: supervise engines and report to the controller."),
    "certs": LazyCommand(
        "gearshift.cli.certs:certs",
        "Private CA, certificates and tokens for a test or small deployment."),
    "controller": LazyCommand(
        "gearshift.cli.daemons:controller",
        "Run the controller: gRPC for agents, gateway and CLI; store; policy loop; /metrics."),
    "decisions": LazyCommand(
        "gearshift.cli.decisions:decisions",
        "What the policy decided, why, and approval of proposed moves."),
    "demo": LazyCommand(
        "gearshift.cli.demo:demo",
        "Run the embedded default fleet on loopback: decisions and migrations, live."),
    "emulate": LazyCommand(
        "gearshift.agents.emulator.cli:emulate",
        "Run an emulated engine (vLLM, trtllm-serve, ...: every engine of the catalog)."),
    "fleet": LazyCommand(
        "gearshift.cli.fleet:fleet",
        "Hosts, deployments and models as the controller sees them."),
    "gateway": LazyCommand(
        "gearshift.gateway.cli:gateway",
        "Route OpenAI requests to the deployments the controller says serve each model."),
    "hosts": LazyCommand(
        "gearshift.cli.enrolment_cmds:hosts",
        "Hosts that enrolled or asked to: approve, revoke, reset, list."),
    "migrations": LazyCommand(
        "gearshift.cli.migrations:migrations",
        "Moves and rollouts in flight and done, step by step."),
    "models": LazyCommand(
        "gearshift.cli.migrations:models",
        "Model revisions: publish new weights and roll them out."),
    "pause": LazyCommand(
        "gearshift.cli.decisions:pause",
        "Stop automatic moves fleet-wide until `gearshift resume`."),
    "policy": LazyCommand(
        "gearshift.cli.policy_cmds:policy",
        "Write, check and replay engine policies."),
    "resume": LazyCommand(
        "gearshift.cli.decisions:resume",
        "Resume automatic moves after `gearshift pause`."),
    "tokens": LazyCommand(
        "gearshift.cli.enrolment_cmds:tokens",
        "Bootstrap tokens that let agents enrol themselves."),
}


class _RootGroup(LazyGroup):
    """The root group: its help names the catalog's engines, read only when help is
    printed (the catalog stays off the start-up path of every other command)."""

    def format_help_text(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from gearshift.common.engines import display_names

        text = inspect.cleandoc(str(getattr(self, "help", None) or "")).partition("\f")[0]
        if text:
            formatter.write_paragraph()
            with formatter.indentation():
                formatter.write_text(text.replace("{engines}", display_names()))


@click.group(cls=_RootGroup, lazy_subcommands=COMMANDS,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--controller", "controller_addr", default=None, envvar="GEARSHIFT_CONTROLLER",
              metavar="HOST:PORT", help="controller address (default 127.0.0.1:50051)")
@click.pass_context
def cli(ctx: click.Context, controller_addr: str | None) -> None:
    """gearshift: adaptive engine selection for LLM serving on {engines}."""
    ctx.obj = {"controller": controller_addr}


def main() -> None:
    cli(prog_name="gearshift")


if __name__ == "__main__":
    main()
