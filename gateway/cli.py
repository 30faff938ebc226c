"""`gearshift gateway`: run the OpenAI-compatible router (the lead registers `gateway` on the root group)."""

from __future__ import annotations

import logging

import click

from gearshift.common.errors import GearshiftError
from gearshift.gateway.limits import MIB, ClientLimits
from gearshift.gateway.server import GatewayConfig, run_event_loop, serve

_DEFAULTS = ClientLimits()


def _host_port(value: str, option: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise click.BadParameter(f"expected HOST:PORT, got {value!r}", param_hint=option)
    return host or "0.0.0.0", int(port)


@click.command("gateway")
@click.option("--controller", envvar="GEARSHIFT_CONTROLLER", metavar="HOST:PORT",
              help="Controller gRPC address to watch routes from (env GEARSHIFT_CONTROLLER).")
@click.option("--listen", default="127.0.0.1:8000", show_default=True, metavar="HOST:PORT",
              help="Address for the OpenAI-compatible API.")
@click.option("--metrics-listen", default=None, metavar="HOST:PORT",
              help="Address for /metrics, /healthz and /readyz (off when not given; the "
                   "API address serves the API only).")
@click.option("--max-connections", type=click.IntRange(min=1),
              default=_DEFAULTS.max_connections, show_default=True,
              help="Client connections kept open at once; more are answered 503.")
@click.option("--body-budget-mib", type=click.IntRange(min=1),
              default=_DEFAULTS.body_budget_bytes // MIB, show_default=True,
              help="MiB of request bodies held at once across all clients; past it, 503.")
@click.option("--max-body-mib", type=click.IntRange(min=1),
              default=_DEFAULTS.max_body_bytes // MIB, show_default=True,
              help="Largest request body in MiB (413 past it).")
@click.option("--routes", "routes_file", type=click.Path(dir_okay=False), default=None,
              help="Static routes file (YAML or JSON: model -> list of {endpoint, weight}); "
                   "with --controller it is the table until the controller sends one.")
@click.option("--gateway-id", default="", help="Name reported to the controller "
              "(default: hostname-pid).")
@click.option("--report-interval", "report_interval_s", type=click.FloatRange(min=0.1),
              default=5.0, show_default=True, help="Seconds between reports to the controller.")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def gateway(controller: str | None, listen: str, metrics_listen: str | None,
            max_connections: int, body_budget_mib: int, max_body_mib: int,
            routes_file: str | None, gateway_id: str, report_interval_s: float,
            log_level: str) -> None:
    """Route OpenAI requests to the deployments the controller says serve each model."""
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, port = _host_port(listen, "--listen")
    ops = None if metrics_listen is None else _host_port(metrics_listen, "--metrics-listen")
    if max_body_mib > body_budget_mib:
        raise click.BadParameter(f"--max-body-mib {max_body_mib} is larger than "
                                 f"--body-budget-mib {body_budget_mib}",
                                 param_hint="--max-body-mib")
    limits = ClientLimits(max_connections=max_connections,
                          body_budget_bytes=body_budget_mib * MIB,
                          max_body_bytes=max_body_mib * MIB)
    config = GatewayConfig(listen_host=host, listen_port=port, controller=controller or None,
                           routes_file=routes_file, metrics_listen=ops, client_limits=limits,
                           gateway_id=gateway_id, report_interval_s=report_interval_s)
    try:
        run_event_loop(serve(config))
    except GearshiftError as err:
        raise click.ClickException(err.message) from None
    except KeyboardInterrupt:
        pass
