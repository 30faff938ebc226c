"""`gearshift tokens create | list | revoke` and `gearshift hosts list | approve | revoke | reset`.

Bootstrap tokens let agents join by themselves (docs/enrolment.md): an agent with
a token makes its own key and gets a certificate from the controller's CA. These
commands need an admin token (`hosts list` a read token); the secret of a new
bootstrap token is printed once, at `create`, and stored only as a hash.
"""

from __future__ import annotations

import re

import click

from gearshift.cli.client import call, control_stub
from gearshift.cli.output import output_option, print_json, print_table, to_dict
from gearshift.common.enum_labels import enum_label
from gearshift.v1 import enrol_pb2

_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: str) -> float:
    """`90s`, `30m`, `24h`, `7d` -> seconds; BadParameter naming the value otherwise."""
    found = _DURATION_RE.match(value.strip())
    if found is None:
        raise click.BadParameter(f"expected a number and s, m, h or d (e.g. 24h), found "
                                 f"{value!r}", param_hint="--ttl")
    return float(found.group(1)) * _UNIT_S[found.group(2)]


def _ts(t: object) -> str:
    seconds = getattr(t, "seconds", 0)
    return t.ToDatetime().strftime("%Y-%m-%d %H:%M:%SZ") if seconds else "-"  # type: ignore[attr-defined]


@click.group()
def tokens() -> None:
    """Bootstrap tokens that let agents enrol themselves."""


@tokens.command("create")
@click.option("--hosts", "host_pattern", required=True, metavar="GLOB",
              help="host ids the token may enrol, as a glob (e.g. 'gpu-*')")
@click.option("--ttl", default="24h", show_default=True, help="validity: 90m, 24h, 7d, …")
@click.option("--one-time", is_flag=True, help="only one host may use it")
@click.option("--auto-approve", is_flag=True,
              help="issue certificates at once; otherwise each host waits for "
              "`gearshift hosts approve`")
@click.option("--description", default="", help="what it is for (shown by `tokens list`)")
@output_option
@click.pass_context
def create(ctx: click.Context, host_pattern: str, ttl: str, one_time: bool, auto_approve: bool,
           description: str, output: str) -> None:
    """Make a bootstrap token; its secret is printed once."""
    request = enrol_pb2.CreateBootstrapTokenRequest(
        host_pattern=host_pattern, ttl_s=parse_duration(ttl), one_time=one_time,
        auto_approve=auto_approve, description=description)
    with control_stub(ctx) as stub:
        resp = call(stub.CreateBootstrapToken, request)
    if output == "json":
        print_json({"token": to_dict(resp.token), "secret_token": resp.secret_token})
        return
    t = resp.token
    click.echo(resp.secret_token)
    click.echo(f"token {t.token_id}: hosts {t.host_pattern!r}, "
               f"{'one-time' if t.one_time else 'reusable'}, "
               f"{'auto-approved' if t.auto_approve else 'approval needed'}, "
               f"until {_ts(t.expires)}. The secret is shown only now.", err=True)


@tokens.command("list")
@output_option
@click.pass_context
def list_tokens(ctx: click.Context, output: str) -> None:
    """Bootstrap tokens (never their secrets)."""
    with control_stub(ctx) as stub:
        resp = call(stub.ListBootstrapTokens, enrol_pb2.ListBootstrapTokensRequest())
    if output == "json":
        print_json([to_dict(t) for t in resp.tokens])
        return
    rows = [(t.token_id, t.host_pattern, "one-time" if t.one_time else "reusable",
             "auto" if t.auto_approve else "manual", _ts(t.expires), t.uses,
             t.used_by or "-", "revoked" if t.revoked else "", t.description)
            for t in resp.tokens]
    print_table("bootstrap tokens", ["id", "hosts", "use", "approval", "expires", "uses",
                                     "used by", "revoked", "description"], rows)


@tokens.command("revoke")
@click.argument("token_id")
@click.pass_context
def revoke_token(ctx: click.Context, token_id: str) -> None:
    """Refuse a bootstrap token from now on (certificates it got stay valid)."""
    with control_stub(ctx) as stub:
        t = call(stub.RevokeBootstrapToken,
                 enrol_pb2.RevokeBootstrapTokenRequest(token_id=token_id))
    click.echo(f"bootstrap token {t.token_id} revoked")


def state_label(v: int) -> str:
    return enum_label(enrol_pb2.EnrolmentState, "ENROLMENT_STATE_", v)


@click.group()
def hosts() -> None:
    """Hosts that enrolled or asked to: approve, revoke, reset, list."""


@hosts.command("list")
@click.option("--pending", is_flag=True, help="only hosts waiting for approval")
@output_option
@click.pass_context
def list_hosts(ctx: click.Context, pending: bool, output: str) -> None:
    """Enrolled, pending and revoked hosts."""
    with control_stub(ctx) as stub:
        resp = call(stub.ListEnrolments, enrol_pb2.ListEnrolmentsRequest(pending_only=pending))
    if output == "json":
        print_json([to_dict(h) for h in resp.hosts])
        return
    if not resp.hosts:
        click.echo("no hosts waiting for approval" if pending else "no enrolled hosts")
        return
    rows = [(h.host_id, state_label(h.state), h.token_id or "-", h.key_fingerprint or "-",
             _ts(h.requested), _ts(h.cert_not_after), h.note) for h in resp.hosts]
    print_table("hosts", ["host", "state", "token", "key", "requested", "certificate until",
                          "note"], rows)


@hosts.command("approve")
@click.argument("host")
@click.option("--reason", default="", help="kept with the host's enrolment")
@click.pass_context
def approve(ctx: click.Context, host: str, reason: str) -> None:
    """Let a pending host have its certificate (at its next request)."""
    with control_stub(ctx) as stub:
        h = call(stub.ApproveHost, enrol_pb2.HostActionRequest(host_id=host, reason=reason))
    click.echo(f"host {h.host_id}: {state_label(h.state)}")


@hosts.command("revoke")
@click.argument("host")
@click.option("--reason", default="", help="kept with the host's enrolment")
@click.pass_context
def revoke(ctx: click.Context, host: str, reason: str) -> None:
    """Refuse a host at once and from now on, on every controller."""
    with control_stub(ctx) as stub:
        h = call(stub.RevokeHost, enrol_pb2.HostActionRequest(host_id=host, reason=reason))
    click.echo(f"host {h.host_id}: {state_label(h.state)}; its stream is closed and it is "
               "refused from now on")


@hosts.command("reset")
@click.argument("host")
@click.option("--reason", default="", help="kept with the host's enrolment")
@click.pass_context
def reset(ctx: click.Context, host: str, reason: str) -> None:
    """Let a host that lost its key enrol again (with a bootstrap token).

    Its enrolment is cleared: its old certificate is refused (its stream closed) until
    its next enrolment, which is then a first one. For a host whose key may have been
    stolen, use `gearshift hosts revoke` (docs/enrolment.md).
    """
    with control_stub(ctx) as stub:
        h = call(stub.ResetHost, enrol_pb2.HostActionRequest(host_id=host, reason=reason))
    click.echo(f"host {h.host_id}: {state_label(h.state)}; its old certificate is refused "
               "until it enrols again with a bootstrap token")
