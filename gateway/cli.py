"""`gearshift gateway`: run the OpenAI-compatible router (the lead registers `gateway` on the root group)."""

from __future__ import annotations

import logging

import click

from gearshift.common.errors import GearshiftError
from gearshift.gateway.server import GatewayConfig, run_event_loop, serve


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
@click.option("--metrics-port", type=int, default=None, metavar="PORT",
              help="Serve /metrics on this port too (it is always on the listen port).")
@click.option("--routes", "routes_file", type=click.Path(dir_okay=False), default=None,
              help="Static routes file (YAML or JSON: model -> list of {endpoint, weight}); "
                   "with --controller it is the table until the controller sends one.")
@click.option("--gateway-id", default="", help="Name reported to the controller "
              "(default: hostname-pid).")
@click.option("--report-interval", "report_interval_s", type=click.FloatRange(min=0.1),
              default=5.0, show_default=True, help="Seconds between reports to the controller.")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def gateway(controller: str | None, listen: str, metrics_port: int | None,
            routes_file: str | None, gateway_id: str, report_interval_s: float,
            log_level: str) -> None:
    """Route OpenAI requests to the deployments the controller says serve each model."""
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, port = _host_port(listen, "--listen")
    config = GatewayConfig(listen_host=host, listen_port=port, controller=controller or None,
                           routes_file=routes_file, metrics_port=metrics_port,
                           gateway_id=gateway_id, report_interval_s=report_interval_s)
    try:
        run_event_loop(serve(config))
    except GearshiftError as err:
        raise click.ClickException(err.message) from None
    except KeyboardInterrupt:
        pass
