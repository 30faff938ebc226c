"""`gearshift certs`: the commands over the private certificate authority
(`gearshift.controller.enrolment.certificate_authority`, which documents the files)."""

from __future__ import annotations

from pathlib import Path

import click

from gearshift.common.errors import GearshiftError
from gearshift.controller.enrolment.certificate_authority import (
    DEFAULT_CONTROLLER_SANS,
    DEFAULT_VALIDITY_DAYS,
    init_certs,
    issue_agent_cert,
)


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


@click.group()
def certs() -> None:
    """Private CA, certificates and tokens for a test or small deployment."""


@certs.command("init")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="directory to write the CA, certificates and tokens into")
@click.option("--hosts", default="", metavar="H1,H2",
              help="agent host ids: one client certificate each")
@click.option("--controller-san", default=",".join(DEFAULT_CONTROLLER_SANS), show_default=True,
              metavar="A,B", help="IP addresses and DNS names the controller is reached at")
@click.option("--days", default=DEFAULT_VALIDITY_DAYS, show_default=True, type=int,
              help="validity of every certificate, in days")
@click.option("--force", is_flag=True, help="overwrite existing files")
def init_cmd(out_dir: Path, hosts: str, controller_san: str, days: int, force: bool) -> None:
    """Write a private CA, controller/agent/gateway/CLI certificates and tokens.yaml."""
    try:
        written = init_certs(out_dir, _split(hosts), _split(controller_san), days, force=force)
    except GearshiftError as exc:
        raise click.ClickException(exc.message) from None
    for name in sorted(written):
        click.echo(f"{name:<24} {written[name]}")
    click.echo("Private keys and token files have mode 0600; copy each agent only its own "
               "agent-<host>.pem, agent-<host>-key.pem and ca.pem.")


@certs.command("issue")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="directory holding ca.pem and ca-key.pem")
@click.option("--host", required=True, help="agent host id")
@click.option("--days", default=DEFAULT_VALIDITY_DAYS, show_default=True, type=int)
@click.option("--force", is_flag=True, help="overwrite an existing certificate (renewal)")
def issue_cmd(out_dir: Path, host: str, days: int, force: bool) -> None:
    """Sign a certificate for one more agent host with the existing CA."""
    try:
        written = issue_agent_cert(out_dir, host, days, force=force)
    except GearshiftError as exc:
        raise click.ClickException(exc.message) from None
    for name in sorted(written):
        click.echo(f"{name:<24} {written[name]}")
