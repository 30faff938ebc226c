"""Argument checks of the policy, decisions and migrations commands, before any RPC.

The commands point at a loopback port that refuses connections: a check that
happened after an RPC would show up as "unavailable" (exit 5) instead of the
usage error asserted here.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

import gearshift.cli.policy_remote  # noqa: F401  (registers apply/show/diff/history)
from gearshift.cli.decisions import decisions, pause, resume
from gearshift.cli.migrations import migrations, models
from gearshift.cli.policy_cmds import policy

ROOT = click.Group("gearshift", commands=[policy, decisions, pause, resume, migrations, models])


@pytest.fixture
def refused_address() -> Iterator[str]:
    """A loopback port that is bound but not listening: every connection is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def run(refused_address: str):  # type: ignore[no-untyped-def]
    def invoke(*args: str) -> Result:
        return CliRunner().invoke(ROOT, list(args), obj={"controller": refused_address},
                                  env={"GEARSHIFT_CONTROLLER": refused_address})
    return invoke


@pytest.fixture
def policy_file(tmp_path: Path) -> str:
    p = tmp_path / "p.yaml"
    p.write_text("kind: EnginePolicy\n")
    return str(p)


def test_apply_with_file_and_version_names_both(run, policy_file: str) -> None:  # type: ignore[no-untyped-def]
    r = run("policy", "apply", policy_file, "--version", "2")
    assert r.exit_code == 2, r.output
    assert "FILE" in r.output and "--version" in r.output and "not both" in r.output


def test_apply_with_neither_file_nor_version(run) -> None:  # type: ignore[no-untyped-def]
    r = run("policy", "apply")
    assert r.exit_code == 2, r.output
    assert "give FILE" in r.output and "--version N" in r.output


@pytest.mark.parametrize("cmd", [("policy", "apply"), ("policy", "diff")])
def test_nonexistent_file_is_a_usage_error(run, tmp_path: Path, cmd: tuple[str, ...]) -> None:  # type: ignore[no-untyped-def]
    missing = str(tmp_path / "nope.yaml")
    r = run(*cmd, missing)
    assert r.exit_code == 2, r.output
    assert "nope.yaml" in r.output and "does not exist" in r.output


def test_version_must_be_positive(run) -> None:  # type: ignore[no-untyped-def]
    r = run("policy", "apply", "--version", "0")
    assert r.exit_code == 2, r.output
    assert "--version" in r.output


def test_non_utf8_policy_file_is_named(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "bin.yaml"
    p.write_bytes(b"name: \xff\xfe\n")
    r = run("policy", "apply", str(p))
    assert r.exit_code == 1, r.output
    assert "bin.yaml: not UTF-8 text" in r.output
    assert "Traceback" not in r.output


def test_diff_trouble_never_exits_1(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """1 means "different" for `policy diff`, like diff(1); errors exit 2 or above."""
    p = tmp_path / "bin.yaml"
    p.write_bytes(b"\xff")
    r = run("policy", "diff", str(p))
    assert r.exit_code == 2 and "not UTF-8" in r.output, r.output
    good = tmp_path / "ok.yaml"
    good.write_text("kind: EnginePolicy\n")
    r = run("policy", "diff", str(good))
    assert r.exit_code == 5 and "unavailable" in r.output, r.output


def test_reject_needs_a_reason(run) -> None:  # type: ignore[no-untyped-def]
    r = run("decisions", "reject", "dec-1")
    assert r.exit_code == 2, r.output
    assert "--reason" in r.output
    r = run("decisions", "reject", "dec-1", "--reason", "  ")
    assert r.exit_code == 2, r.output
    assert "non-empty reason" in r.output


def test_abort_and_publish_need_their_options(run) -> None:  # type: ignore[no-untyped-def]
    r = run("migrations", "abort", "mig-1")
    assert r.exit_code == 2 and "--reason" in r.output, r.output
    r = run("models", "publish", "llama")
    assert r.exit_code == 2 and "--revision" in r.output, r.output


@pytest.mark.parametrize("cmd", [
    ("policy", "show"), ("policy", "history"), ("decisions", "list"), ("decisions", "explain", "x"),
    ("decisions", "evaluate"), ("pause",), ("resume",), ("migrations", "list"),
    ("migrations", "show", "x"), ("models", "publish", "m", "--revision", "r"),
])
def test_unknown_output_format(run, cmd: tuple[str, ...]) -> None:  # type: ignore[no-untyped-def]
    r = run(*cmd, "-o", "yaml")
    assert r.exit_code == 2, r.output
    assert "'yaml' is not one of 'table', 'json'" in r.output


def test_unknown_status_and_bad_limit(run) -> None:  # type: ignore[no-untyped-def]
    r = run("decisions", "list", "--status", "maybe")
    assert r.exit_code == 2, r.output
    assert "proposed" in r.output and "rolled_back" in r.output
    r = run("decisions", "list", "--limit", "0")
    assert r.exit_code == 2 and "--limit" in r.output, r.output


def test_valid_arguments_reach_the_controller(run) -> None:  # type: ignore[no-untyped-def]
    """The control case: with valid arguments the refused connection is what fails."""
    r = run("decisions", "reject", "dec-1", "--reason", "too risky today")
    assert r.exit_code == 5, r.output
    assert "Traceback" not in r.output
