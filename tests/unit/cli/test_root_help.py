"""`gearshift --help` names every engine gearshift serves on."""

from __future__ import annotations

from click.testing import CliRunner

from gearshift.cli.main import cli
from gearshift.common.engines import CATALOG


def test_root_help_names_every_engine_of_the_catalog() -> None:
    result = CliRunner().invoke(cli, ["--help"], terminal_width=10_000)
    assert result.exit_code == 0, result.output
    first = result.output.split("\n\n")[1]  # the group's one-line description
    assert "SGLang" in first, first
    for entry in CATALOG:
        assert entry.display_name in first, (entry.name, first)
