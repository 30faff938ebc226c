"""A click group whose subcommands are imported only when one of them runs.

click's documented lazy-group pattern: the group knows each subcommand by name and
by the `module:attribute` that defines it, and imports that module in `get_command`.
The group's own `--help` lists every subcommand with the short help kept in the
registry, so listing the commands imports none of them: a command's module (and the
libraries it needs: gRPC, numpy, scikit-learn, the controller) costs only the
commands that use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import click


@dataclass(frozen=True)
class LazyCommand:
    """Where a subcommand is defined, and its one-line help for the group's listing."""

    target: str      # "package.module:attribute"
    short_help: str  # the first line of the command's docstring (a test keeps them equal)

    def load(self) -> click.Command:
        module_name, _, attr = self.target.partition(":")
        cmd = getattr(importlib.import_module(module_name), attr)
        if not isinstance(cmd, click.Command):
            raise TypeError(f"{self.target} is a {type(cmd).__name__}, not a click command")
        return cmd


class LazyGroup(click.Group):
    """A group whose `lazy_subcommands` are imported the first time they are asked for."""

    def __init__(self, *args: Any, lazy_subcommands: Mapping[str, LazyCommand] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_subcommands = dict(lazy_subcommands or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.lazy_subcommands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        lazy = self.lazy_subcommands.get(cmd_name)
        if lazy is not None and cmd_name not in self.commands:
            self.add_command(lazy.load(), cmd_name)
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """As click's, but a subcommand not loaded yet is listed from the registry."""
        names = [n for n in self.list_commands(ctx)
                 if n not in self.commands or not self.commands[n].hidden]
        if not names:
            return
        # click allows three times the default spacing between a name and its help.
        limit = formatter.width - 6 - max(len(n) for n in names)
        rows = []
        for name in names:
            # A stand-in built from the registry's text truncates it as click would the real one.
            cmd = self.commands.get(name) or click.Command(
                name, help=self.lazy_subcommands[name].short_help)
            rows.append((name, cmd.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)
