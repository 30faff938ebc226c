"""The command tree registered by name: every registry entry loads the command it names,
with the short help the registry lists, and `--help` reads the same before and after
the commands are imported."""

from __future__ import annotations

from collections.abc import Iterator

import click
from click.testing import CliRunner

from gearshift.cli.lazy_group import LazyCommand, LazyGroup
from gearshift.cli.main import cli

HELP_WIDTH = 10_000  # no truncation: the whole first sentence is compared


def _lazy_groups(group: click.Group, path: str = "gearshift") -> Iterator[tuple[str, LazyGroup]]:
    if isinstance(group, LazyGroup):
        yield path, group
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        sub = group.get_command(ctx, name)
        if isinstance(sub, click.Group):
            yield from _lazy_groups(sub, f"{path} {name}")


def test_every_registered_command_loads_with_the_short_help_listed() -> None:
    groups = dict(_lazy_groups(cli))
    assert {"gearshift", "gearshift policy", "gearshift models"} <= set(groups)
    for path, group in groups.items():
        for name, entry in group.lazy_subcommands.items():
            cmd = entry.load()
            assert cmd.name == name, f"{path} {name}: {entry.target} is named {cmd.name!r}"
            listed = click.Command(name, help=entry.short_help).get_short_help_str(HELP_WIDTH)
            assert cmd.get_short_help_str(HELP_WIDTH) == listed, f"{path} {name}"


def test_help_lists_the_same_before_and_after_the_commands_are_imported() -> None:
    runner = CliRunner()
    fresh = LazyGroup("gearshift", lazy_subcommands=cli.lazy_subcommands, params=cli.params,
                      help=cli.help)
    before = runner.invoke(fresh, ["--help"], prog_name="gearshift")
    assert before.exit_code == 0, before.output
    assert not fresh.commands  # listing imported nothing
    for name in fresh.list_commands(click.Context(fresh)):
        assert fresh.get_command(click.Context(fresh), name) is not None
    after = runner.invoke(fresh, ["--help"], prog_name="gearshift")
    assert set(fresh.commands) == set(cli.lazy_subcommands)
    assert after.output == before.output
    assert "policy      Write, check and replay engine policies." in before.output


def test_an_unknown_command_is_refused_by_name() -> None:
    result = CliRunner().invoke(cli, ["polcy", "validate"])
    assert result.exit_code == 2
    assert "No such command 'polcy'" in result.output


def test_a_registry_entry_that_names_no_command_is_a_clear_error() -> None:
    bad = LazyGroup("g", lazy_subcommands={"x": LazyCommand("gearshift.cli.main:COMMANDS", "x")})
    result = CliRunner().invoke(bad, ["x"])
    assert isinstance(result.exception, TypeError)
    assert "gearshift.cli.main:COMMANDS is a dict, not a click command" in str(result.exception)
