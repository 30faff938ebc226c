"""The gateway process: API listener, optional operator listener, controller link.

`Gateway` starts and stops everything in one event loop, so tests run it
in-process on port 0 and the CLI runs it until a signal arrives. The routing
table comes from the controller (`controller`), from a static file (`routes_file`),
or both: the file is then the table served until the controller sends its own.

The API listener serves the OpenAI API only, plus vLLM's `/health` probe (200 with a
routing table, else 503, no body). `/metrics`, `/healthz` (alive) and `/readyz` (has a
routing table) are on a separate operator listener (`metrics_listen`), so that nothing
about the gateway's insides faces clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from gearshift.common.credentials import TlsFiles, load_token, secure_channel
from gearshift.common.endpoints import parse_controllers
from gearshift.common.errors import ConfigError
from gearshift.common.ops_http import OpsListener
from gearshift.gateway.controller_link import (
    BACKOFF_INITIAL_S,
    BACKOFF_MAX_S,
    REPORT_INTERVAL_S,
    ControllerLink,
    report_loop,
    watch_routes,
)
from gearshift.gateway.limits import ClientLimits
from gearshift.gateway.listener import HttpListener
from gearshift.gateway.metrics import GatewayMetrics
from gearshift.gateway.proxy import (
    UPSTREAM_BODY_TIMEOUT_S,
    UPSTREAM_CONNECTIONS_LIMIT,
    UPSTREAM_READ_TIMEOUT_S,
    Router,
)
from gearshift.gateway.routes import RoutingTable, load_routes_file

log = logging.getLogger(__name__)
T = TypeVar("T")

# Seconds in-flight requests get to finish when the gateway stops.
SHUTDOWN_GRACE_S = 10.0


def default_gateway_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class GatewayConfig:
    """What `gearshift gateway` was asked to do."""

    listen_host: str = "127.0.0.1"
    listen_port: int = 8000
    controller: str | None = None  # HOST:PORT of the controller's gRPC server
    routes_file: str | None = None
    metrics_listen: tuple[str, int] | None = None  # /metrics, /healthz, /readyz; None: off
    gateway_id: str = ""
    report_interval_s: float = REPORT_INTERVAL_S
    backoff_initial_s: float = BACKOFF_INITIAL_S
    backoff_max_s: float = BACKOFF_MAX_S
    connections_limit: int = UPSTREAM_CONNECTIONS_LIMIT
    client_limits: ClientLimits = field(default_factory=ClientLimits)
    upstream_read_timeout_s: float = UPSTREAM_READ_TIMEOUT_S
    upstream_body_timeout_s: float = UPSTREAM_BODY_TIMEOUT_S

    def check(self, have_table: bool = False) -> None:
        """Raise ConfigError naming the option that is wrong."""
        if not self.controller and not self.routes_file and not have_table:
            raise ConfigError("gateway: give --controller HOST:PORT (or GEARSHIFT_CONTROLLER) "
                              "or --routes FILE, so it knows where to send requests")
        if self.controller is not None:
            try:
                parse_controllers(self.controller)
            except ConfigError as err:
                raise ConfigError(f"gateway: {err.message}") from None
        ports: list[tuple[str, int | None]] = [
            ("--listen", self.listen_port),
            ("--metrics-listen", None if self.metrics_listen is None else self.metrics_listen[1])]
        for name, port in ports:
            if port is not None and not 0 <= port <= 65535:
                raise ConfigError(f"gateway: {name} port must be 0..65535, got {port}")
        for problem in self.client_limits.check():
            raise ConfigError(f"gateway: {problem}")


class Gateway:
    """One gateway: start it, read `url`, stop it."""

    def __init__(self, config: GatewayConfig, registry: CollectorRegistry | None = None,
                 rng: Callable[[], float] | None = None,
                 table: RoutingTable | None = None) -> None:
        """`table` is a starting routing table (instead of, or before, routes file/controller)."""
        config.check(have_table=table is not None)
        self.config = config
        self.gateway_id = config.gateway_id or default_gateway_id()
        self.metrics = GatewayMetrics(registry=registry)
        if config.routes_file:
            table = load_routes_file(config.routes_file)
        self.router = Router(self.metrics, table=table, rng=rng,
                             connections_limit=config.connections_limit,
                             read_timeout_s=config.upstream_read_timeout_s,
                             body_timeout_s=config.upstream_body_timeout_s)
        self._listener: HttpListener | None = None
        self._ops: OpsListener | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._link: ControllerLink | None = None
        self.port = 0
        self.metrics_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.listen_host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        """http://HOST:PORT of the operator listener (empty when it is off)."""
        if self.config.metrics_listen is None or not self.metrics_port:
            return ""
        return f"http://{self.config.metrics_listen[0]}:{self.metrics_port}"

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        config = self.config
        listener = HttpListener(self.router.handle, config.client_limits,
                                on_refusal=self.metrics.refused)
        self.metrics.track_clients(config.client_limits, lambda: len(listener.connections),
                                   lambda: listener.budget.used)
        self.port = await _bind(listener.start, config.listen_host, config.listen_port)
        self._listener = listener
        if config.metrics_listen is not None:
            self._ops = OpsListener(self.metrics.registry, ready=lambda: self.router.table_loaded)
            self.metrics_port = await _bind(self._ops.start, *config.metrics_listen)
        if self.config.controller:
            # TLS files from $GEARSHIFT_TLS_*, token from $GEARSHIFT_TOKEN(_FILE): never argv.
            tls, token = TlsFiles.from_env(), load_token()
            self._link = ControllerLink(
                self.config.controller,
                lambda addr: secure_channel(addr, tls, token, aio=True))
            self._tasks.append(asyncio.create_task(watch_routes(
                self._link, self.gateway_id, self.router.set_table,
                backoff_initial_s=self.config.backoff_initial_s,
                backoff_max_s=self.config.backoff_max_s)))
            self._tasks.append(asyncio.create_task(report_loop(
                self._link, self.router, self.gateway_id, self.config.report_interval_s)))
        log.info("gateway %s listening on %s (routes from %s)", self.gateway_id, self.url,
                 self.config.controller or self.router.table.source)


    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._ops is not None:
            await self._ops.stop()
            self._ops = None
        if self._listener is not None:
            await self._listener.stop(SHUTDOWN_GRACE_S)
            self._listener = None
        self.router.close()
        if self._link is not None:
            await self._link.close()
            self._link = None


async def _bind(start: Callable[[str, int], Coroutine[Any, Any, int]], host: str,
                port: int) -> int:
    try:
        return await start(host, port)
    except OSError as err:
        raise ConfigError(f"gateway: cannot listen on {host}:{port}: "
                          f"{err.strerror or err}") from None


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` on uvloop when it is installed (less CPU per request), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)  # type: ignore[no-any-return]


async def serve(config: GatewayConfig) -> None:
    """Run a gateway until SIGINT or SIGTERM."""
    gateway = Gateway(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await gateway.start()
    try:
        await stop.wait()
    finally:
        log.info("gateway stopping; letting in-flight requests finish")
        await gateway.stop()
