"""`gearshift policy apply | show | diff | history`: policies held by the controller.

The `policy` group of `policy_cmds` lists these commands and imports this module
when one of them runs. Arguments are checked before any RPC, so a usage mistake
never needs a controller.
"""

from __future__ import annotations

import difflib
import getpass
import os
import socket

import click

from gearshift.cli.client import call, control_stub
from gearshift.cli.explain import fmt_time
from gearshift.cli.output import output_option, print_json, print_table, to_dict
from gearshift.cli.policy_cmds import echo_warnings
from gearshift.common.errors import GearshiftError
from gearshift.policies.loader import read_policy_text as read_text
from gearshift.v1 import control_pb2

DIGEST_SHOWN_CHARS = 12
DIFF_EXIT_DIFFERENT = 1  # like diff(1): 0 identical, 1 different, >1 trouble
DIFF_EXIT_TROUBLE = 2


def operator_id() -> str:
    """`$USER@hostname`, recorded with applied policies and reviewed decisions."""
    user = os.environ.get("USER")
    if not user:
        try:
            user = getpass.getuser()
        except (OSError, KeyError):
            user = "unknown"
    return f"{user}@{socket.gethostname()}"


def read_policy_text(path: str) -> str:
    try:
        return read_text(path)
    except GearshiftError as exc:
        raise click.ClickException(exc.message) from None


def _describe(p: control_pb2.PolicyVersion) -> str:
    return f"version {p.version} ({p.name or '?'}, {p.mode or '?'})"


@click.command("apply")
@click.argument("file", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--version", "version", type=click.IntRange(min=1), default=None, metavar="N",
              help="make stored version N active again instead of applying FILE")
@click.option("--comment", default="", help="why, kept in the policy history")
@click.option("--strict", is_flag=True, default=False,
              help="refuse a policy with warnings (conditions that never hold, NaN, ...)")
@output_option
@click.pass_context
def apply(ctx: click.Context, file: str | None, version: int | None, comment: str,
          strict: bool, output: str) -> None:
    """Apply the policy in FILE on the controller, or restore --version N."""
    if file is not None and version is not None:
        raise click.UsageError("give either FILE or --version N, not both "
                               f"(found FILE {file!r} and --version {version})")
    if file is None and version is None:
        raise click.UsageError("give FILE (a policy to apply) or --version N "
                               "(a stored version to make active again)")
    req = control_pb2.ApplyPolicyRequest(applied_by=operator_id(), comment=comment, strict=strict)
    if file is not None:
        req.yaml_text = read_policy_text(file)
        req.source = file
    else:
        assert version is not None
        req.restore_version = version
    with control_stub(ctx) as stub:
        resp = call(stub.ApplyPolicy, req)
    if output == "json":
        print_json(to_dict(resp))
        return
    echo_warnings(list(resp.warnings))
    if resp.changed:
        click.echo(f"applied {_describe(resp.policy)}")
    else:
        click.echo(f"unchanged: version {resp.policy.version} is already active")


def _get(ctx: click.Context, version: int | None) -> control_pb2.PolicyVersion:
    with control_stub(ctx) as stub:
        return call(stub.GetPolicy, control_pb2.GetPolicyRequest(version=version or 0))


@click.command("show")
@click.option("--version", "version", type=click.IntRange(min=1), default=None, metavar="N",
              help="a stored version (default: the active one)")
@output_option
@click.pass_context
def show(ctx: click.Context, version: int | None, output: str) -> None:
    """Print the active policy (or version N) as applied, after a comment header."""
    p = _get(ctx, version)
    if output == "json":
        print_json(to_dict(p))
        return
    state = "active" if p.active else "inactive"
    click.echo(f"# version {p.version} ({state}), {p.name or '?'}, mode {p.mode or '?'}, "
               f"sha256 {p.digest}")
    click.echo(f"# applied {fmt_time(p.applied_at)} by {p.applied_by or '?'}"
               + (f": {p.comment}" if p.comment else ""))
    click.echo(p.yaml_text, nl=not p.yaml_text.endswith("\n"))


@click.command("diff")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--version", "version", type=click.IntRange(min=1), default=None, metavar="N",
              help="compare with stored version N (default: the active one)")
@output_option
@click.pass_context
def diff(ctx: click.Context, file: str, version: int | None, output: str) -> None:
    """Unified diff from the active policy (or version N) to FILE.

    Exits like diff(1): 0 when they are identical, 1 when they differ, and the
    gearshift error codes on trouble (never 1: at least 2).
    """
    try:
        new_text = read_policy_text(file)
        p = _get(ctx, version)
    except click.ClickException as exc:
        exc.exit_code = max(exc.exit_code, DIFF_EXIT_TROUBLE)  # type: ignore[misc]  # 1 = different
        raise
    label = f"version {p.version}" + (" (active)" if p.active else "")
    lines = list(difflib.unified_diff(p.yaml_text.splitlines(keepends=True),
                                      new_text.splitlines(keepends=True),
                                      fromfile=label, tofile=file))
    if output == "json":
        print_json({"version": p.version, "file": file, "identical": not lines,
                    "diff": "".join(_terminated(lines))})
    elif not lines:
        click.echo(f"no differences: {file} matches {label}")
    else:
        click.echo("".join(_terminated(lines)), nl=False)
    if lines:
        ctx.exit(DIFF_EXIT_DIFFERENT)


def _terminated(lines: list[str]) -> list[str]:
    """Diff lines each ending in a newline (a file without a final newline says so)."""
    return [ln if ln.endswith("\n") else ln + "\n\\ No newline at end of file\n" for ln in lines]


@click.command("history")
@output_option
@click.pass_context
def history(ctx: click.Context, output: str) -> None:
    """Every applied policy version, the active one marked with *."""
    with control_stub(ctx) as stub:
        resp = call(stub.PolicyHistory, control_pb2.PolicyHistoryRequest())
    if output == "json":
        print_json([to_dict(v) for v in resp.versions])
        return
    rows = [(v.version, "*" if v.active else "", v.name, v.mode, v.digest[:DIGEST_SHOWN_CHARS],
             fmt_time(v.applied_at), v.applied_by, v.comment) for v in resp.versions]
    print_table("policy history", ["version", "active", "name", "mode", "digest", "applied at",
                                   "by", "comment"], rows)
