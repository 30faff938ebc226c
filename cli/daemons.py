"""`gearshift controller` and `gearshift agent`: the long-running processes."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import click
from click.core import ParameterSource

from gearshift.common.errors import ConfigError, GearshiftError

if TYPE_CHECKING:
    from gearshift.agents.config import AgentConfig


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@click.group(invoke_without_command=True)
@click.option("--listen", default="127.0.0.1:50051", show_default=True, help="gRPC HOST:PORT (port 0 picks one)")
@click.option("--db", "db_url", default="", envvar="GEARSHIFT_DB",
              help="store URL: sqlite:///PATH or postgresql+psycopg://…; default SQLite under --data-dir")
@click.option("--data-dir", type=click.Path(path_type=Path), default=Path("./data"), show_default=True)
@click.option("--metrics-port", type=int, default=None,
              help="serve /metrics, /healthz, /readyz on 127.0.0.1:PORT")
@click.option("--metrics-listen", default="", metavar="HOST:PORT", envvar="GEARSHIFT_METRICS_LISTEN",
              help="serve /metrics, /healthz, /readyz on HOST:PORT (plain HTTP, nothing secret)")
@click.option("--report-interval", "report_interval_s", type=float, default=10.0, show_default=True,
              help="seconds between agent reports")
@click.option("--history-resolution", "history_resolution_s", type=float, default=60.0,
              show_default=True, help="seconds between the request-rate samples the policy sees")
@click.option("--gpu-price-per-hour", "gpu_price_per_hour", type=float, default=None,
              envvar="GEARSHIFT_GPU_PRICE_PER_HOUR", metavar="USD",
              help="the fleet's price of a GPU-hour, for policies that set no "
              "spec.cost.pricePerGpuHour (a host's label gearshift.dev/gpu-price-per-hour "
              "overrides it); without any price no move can be priced")
@click.option("--canary-steps", default="0.1,0.25,0.5", show_default=True,
              help="traffic shares of the canary steps of a migration")
@click.option("--analysis-intervals", type=int, default=3, show_default=True,
              help="good report intervals needed per canary step")
@click.option("--tls-cert", type=click.Path(path_type=Path, dir_okay=False), default=None,
              envvar="GEARSHIFT_TLS_SERVER_CERT", help="server certificate (PEM); without it: "
              "plaintext, loopback only")
@click.option("--tls-key", type=click.Path(path_type=Path, dir_okay=False), default=None,
              envvar="GEARSHIFT_TLS_SERVER_KEY", help="server private key (PEM file)")
@click.option("--tls-ca", type=click.Path(path_type=Path, dir_okay=False), default=None,
              envvar="GEARSHIFT_TLS_CLIENT_CA", help="CA of client certificates: mutual TLS")
@click.option("--tokens-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="bearer tokens with roles read/admin (else $GEARSHIFT_TOKENS)")
@click.option("--advertise", default="", metavar="HOST:PORT",
              help="address clients reach this controller at (default: the listen address); "
              "followers name the leader by it")
@click.option("--lease-ttl", "lease_ttl_s", type=float, default=10.0, show_default=True,
              help="HA on PostgreSQL: seconds a leader's lease lasts without renewal")
@click.option("--enrol-listen", default="", metavar="HOST:PORT",
              help="enrolment listener for agents joining with a bootstrap token (server TLS "
              "only; needs --ca-key); see docs/enrolment.md")
@click.option("--ca-key", type=click.Path(path_type=Path, dir_okay=False), default=None,
              envvar="GEARSHIFT_TLS_CA_KEY",
              help="the CA's private key (PEM file): signs enrolled and renewed agent "
              "certificates")
@click.option("--enrolled-cert-ttl", "enrolled_cert_ttl_s", type=float, default=86400.0,
              show_default=True, help="seconds an enrolled agent's certificate is valid "
              "(agents renew at two thirds)")
@click.option("--controller-id", default="", help="name of this controller (default: host-pid)")
@click.option("--ready-file", type=click.Path(path_type=Path), default=None,
              help="write 'GRPC_PORT METRICS_PORT ENROL_PORT' here once serving (for scripts)")
@click.option("--event-loop", type=click.Choice(["uvloop", "asyncio"]), default=None,
              help="the event loop that carries every agent stream: uvloop (the default "
              "where installed) spends less CPU per report than asyncio's own")
@click.option("--log-level", default="info", show_default=True)
@click.pass_context
def controller(ctx: click.Context, listen: str, db_url: str, data_dir: Path,
               metrics_port: int | None, metrics_listen: str, report_interval_s: float,
               history_resolution_s: float, gpu_price_per_hour: float | None, canary_steps: str,
               analysis_intervals: int, tls_cert: Path | None,
               tls_key: Path | None, tls_ca: Path | None, tokens_file: Path | None,
               advertise: str, lease_ttl_s: float, enrol_listen: str, ca_key: Path | None,
               enrolled_cert_ttl_s: float, controller_id: str, ready_file: Path | None,
               event_loop: str | None, log_level: str) -> None:
    """Run the controller: gRPC for agents, gateway and CLI; store; policy loop; /metrics.

    Several controllers on one PostgreSQL database elect one leader; on SQLite
    there is one controller. `gearshift controller status` shows who leads.
    """
    if ctx.invoked_subcommand is not None:
        return
    from gearshift.common.event_loop import run_event_loop
    from gearshift.controller.server import ControllerConfig, run_controller

    setup_logging(log_level)
    try:
        steps = tuple(float(x) for x in canary_steps.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, found {canary_steps!r}",
                                 param_hint="--canary-steps") from None
    try:
        cfg = ControllerConfig(listen=listen, db_url=db_url, data_dir=data_dir,
                               metrics_port=metrics_port, metrics_listen=metrics_listen,
                               report_interval_s=report_interval_s,
                               history_resolution_s=history_resolution_s,
                               gpu_price_per_hour=gpu_price_per_hour, canary_steps=steps,
                               analysis_intervals=analysis_intervals, tls_cert=tls_cert,
                               tls_key=tls_key, tls_ca=tls_ca, tokens_file=tokens_file,
                               advertise=advertise, lease_ttl_s=lease_ttl_s,
                               enrol_listen=enrol_listen, ca_key=ca_key,
                               enrolled_cert_ttl_s=enrolled_cert_ttl_s)
        if controller_id:
            cfg.controller_id = controller_id
        cfg.validate()
        run_event_loop(run_controller(cfg, ready_file=ready_file), event_loop)
    except GearshiftError as err:
        raise click.ClickException(_name_env_sources(ctx, err.message)) from None


@click.group(invoke_without_command=True)
# No envvar: $GEARSHIFT_CONTROLLER is the CLI's (and the gateway's), often exported on the
# machine an agent is tried on; it must not move an agent off its config's controller.
@click.option("--controller", "controller_addr", default=None,
              help="controller HOST:PORT (overrides the config file)")
@click.option("--config", "config_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="agent YAML config")
@click.option("--host-id", default=None, envvar="GEARSHIFT_HOST_ID",
              help="host identity (overrides the config file)")
@click.option("--bind-host", default=None, envvar="GEARSHIFT_BIND_HOST", metavar="ADDRESS",
              help="address engines listen on and are reached at, e.g. a pod's IP "
              "(overrides the config file's bind_host)")
@click.option("--workdir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="work dir: engine logs and records (overrides the config file)")
@click.option("--metrics-listen", default=None, metavar="HOST:PORT",
              envvar="GEARSHIFT_METRICS_LISTEN",
              help="serve /metrics, /healthz, /readyz on HOST:PORT (overrides the config file)")
@click.option("--enrol-controller", default=None, metavar="HOST:PORT",
              envvar="GEARSHIFT_ENROL_CONTROLLER",
              help="the controller's enrolment listener(s): join with a bootstrap token "
              "instead of a pre-made certificate (docs/enrolment.md)")
@click.option("--bootstrap-token-file", type=click.Path(path_type=Path, dir_okay=False),
              default=None, envvar="GEARSHIFT_BOOTSTRAP_TOKEN_FILE",
              help="file holding the bootstrap token (or $GEARSHIFT_BOOTSTRAP_TOKEN); read "
              "only while the agent has no valid certificate")
@click.option("--drain-on-exit", is_flag=True, default=None,
              help="stop the engines when the agent exits (decommissioning); by default "
              "they keep serving and the next agent adopts them")
@click.option("--log-level", default="info", show_default=True)
@click.pass_context
def agent(ctx: click.Context, controller_addr: str | None, config_path: Path | None,
          host_id: str | None, bind_host: str | None, workdir: Path | None,
          metrics_listen: str | None, enrol_controller: str | None,
          bootstrap_token_file: Path | None, drain_on_exit: bool | None,
          log_level: str) -> None:
    """Run the agent on a GPU host: supervise engines and report to the controller.

    Engines outlive the agent: on SIGTERM or a crash they keep serving, and the
    next agent started on the same work dir adopts them without a restart.
    Without `tls:` in the config, the CA comes from $GEARSHIFT_TLS_CA (and the name to
    verify from _SERVER_NAME), e.g. as a systemd credential, and the agent enrols: it
    makes its key and asks --enrol-controller to sign it, proving itself with the
    bootstrap token (never on the command line). The CLI's $GEARSHIFT_TLS_CERT, _KEY,
    $GEARSHIFT_TOKEN* and $GEARSHIFT_CONTROLLER are never read: a pre-made agent
    certificate goes in the config, `tls: {ca, cert, key}`. Relative paths in the
    config file are taken from its directory.
    """
    if ctx.invoked_subcommand is not None:
        return
    from gearshift.agents.config import load_agent_config
    from gearshift.agents.daemon import run_agent

    setup_logging(log_level)
    flags = {"controller": controller_addr, "host_id": host_id, "bind_host": bind_host,
             "workdir": workdir, "drain_on_exit": drain_on_exit,
             "metrics_listen": metrics_listen, "enrol_controller": enrol_controller,
             "bootstrap_token_file": bootstrap_token_file}
    origins = {name: f"${var}" for name, var in _env_sourced(ctx).items()}
    tls = _tls_from_env()
    if tls is not None:
        origins["tls"] = f"${TLS_CA_ENV}"
    try:
        cfg = load_agent_config(config_path, flags, defaults={"tls": tls}, origins=origins)
        if tls is not None and cfg.tls is not None and cfg.tls.ca == Path(tls["ca"]):
            _check_readable(cfg.tls.ca, TLS_CA_ENV)  # its own config names no CA
        asyncio.run(run_agent(cfg))
    except GearshiftError as err:
        raise click.ClickException(_name_env_sources(ctx, err.message)) from None


TLS_CA_ENV = "GEARSHIFT_TLS_CA"
TLS_SERVER_NAME_ENV = "GEARSHIFT_TLS_SERVER_NAME"
# The CLI's client certificate (README, "Run on real hosts"): never an agent's.
CLI_ONLY_TLS_ENV = ("GEARSHIFT_TLS_CERT", "GEARSHIFT_TLS_KEY")


def _tls_from_env() -> dict[str, str] | None:
    """The agent's `tls:` from $GEARSHIFT_TLS_CA (and _SERVER_NAME), for a config file
    without one: a CA and no certificate, so the agent enrols (the systemd unit and the
    Kubernetes DaemonSet hand the CA over so). $GEARSHIFT_TLS_CERT/_KEY are the CLI's
    certificate and are not read."""
    ignored = [f"${v}" for v in CLI_ONLY_TLS_ENV if os.environ.get(v)]
    if ignored:
        logging.getLogger(__name__).info(
            "not read by the agent: %s (the CLI's certificate; an agent's own goes in its "
            "config as tls: {ca, cert, key})", ", ".join(ignored))
    ca = os.environ.get(TLS_CA_ENV)
    if not ca:
        return None
    out = {"ca": ca}
    if os.environ.get(TLS_SERVER_NAME_ENV):
        out["server_name"] = os.environ[TLS_SERVER_NAME_ENV]
    return out


def _check_readable(path: Path, var: str) -> None:
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"${var}={path}: cannot read: {exc.strerror or exc} (the agent's "
                          f"CA when its config has no tls:)") from None


def _env_sourced(ctx: click.Context) -> dict[str, str]:
    """{parameter name: its environment variable} of the options whose value came from
    the environment."""
    out = {}
    for param in ctx.command.params:
        if (param.name and isinstance(param.envvar, str)
                and ctx.get_parameter_source(param.name) is ParameterSource.ENVIRONMENT):
            out[param.name] = param.envvar
    return out


def _name_env_sources(ctx: click.Context, message: str) -> str:
    """`message`, noting the environment variable of each option whose value came from
    one and that the message names (by its flag or its value)."""
    notes = []
    sourced = _env_sourced(ctx)
    for param in ctx.command.params:
        if param.name in sourced and isinstance(param, click.Option):
            flag, value = param.opts[0], str(ctx.params.get(param.name, ""))
            if f"${sourced[param.name]}" in message:  # named already (the agent's config)
                continue
            if flag in message or (len(value) >= 4 and value in message):
                notes.append(f"{flag} from ${sourced[param.name]}")
    return f"{message} ({'; '.join(notes)})" if notes else message


@agent.command("drain")
@click.option("--config", "config_path", type=click.Path(path_type=Path, dir_okay=False),
              default=None, help="agent YAML config (for its work dir)")
@click.option("--workdir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="the agent's work dir (overrides the config file)")
@click.option("--grace", "grace_s", type=float, default=30.0, show_default=True,
              help="seconds each engine gets to finish in-flight requests before SIGKILL")
def agent_drain(config_path: Path | None, workdir: Path | None, grace_s: float) -> None:
    """Stop the engines a stopped agent left serving on this host, and remove its engine
    containers (refused while an agent runs on the work dir)."""
    from gearshift.agents.config import load_agent_config
    from gearshift.agents.handover import drain_recorded

    try:
        cfg = load_agent_config(config_path, {"workdir": workdir})
        lines = drain_recorded(cfg.workdir, grace_s)
        if cfg.containers is not None:
            lines += asyncio.run(_drain_containers(cfg, grace_s))
    except GearshiftError as err:
        raise click.ClickException(err.message) from None
    for line in lines or [f"no engines recorded in {cfg.workdir}"]:
        click.echo(line)


async def _drain_containers(cfg: AgentConfig, grace_s: float) -> list[str]:
    from gearshift.agents.handover import WorkdirLock
    from gearshift.agents.runtimes.containers import ContainerRuntime, drain_containers

    assert cfg.containers is not None
    runtime = ContainerRuntime(cfg.containers)
    try:
        with WorkdirLock(cfg.workdir):
            return await drain_containers(runtime, cfg.host_id, grace_s)
    finally:
        await runtime.close()


@controller.command("status")
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table",
              show_default=True)
@click.pass_context
def controller_status(ctx: click.Context, output: str) -> None:
    """Leader, epoch and lease age, as every controller in --controller sees them."""
    from gearshift.cli.ha_status import show_status

    show_status(ctx, output)
