"""The gateway process: HTTP listener, optional metrics listener, controller link.

`Gateway` starts and stops everything in one event loop, so tests run it
in-process on port 0 and the CLI runs it until a signal arrives. The routing
table comes from the controller (`controller`), from a static file (`routes_file`),
or both: the file is then the table served until the controller sends its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from gearshift.common.credentials import TlsFiles, load_token, secure_channel
from gearshift.common.endpoints import parse_controllers
from gearshift.common.errors import ConfigError
from gearshift.gateway.controller_link import (
    BACKOFF_INITIAL_S,
    BACKOFF_MAX_S,
    REPORT_INTERVAL_S,
    ControllerLink,
    report_loop,
    watch_routes,
)
from gearshift.gateway.listener import Handler, HttpListener
from gearshift.gateway.metrics import GatewayMetrics
from gearshift.gateway.proxy import UPSTREAM_CONNECTIONS_LIMIT, Router
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
    metrics_port: int | None = None  # None: /metrics on the listen port only
    metrics_host: str | None = None  # defaults to listen_host
    gateway_id: str = ""
    report_interval_s: float = REPORT_INTERVAL_S
    backoff_initial_s: float = BACKOFF_INITIAL_S
    backoff_max_s: float = BACKOFF_MAX_S
    connections_limit: int = UPSTREAM_CONNECTIONS_LIMIT

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
        ports: list[tuple[str, int | None]] = [("--listen", self.listen_port),
                                               ("--metrics-port", self.metrics_port)]
        for name, port in ports:
            if port is not None and not 0 <= port <= 65535:
                raise ConfigError(f"gateway: {name} port must be 0..65535, got {port}")


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
                             connections_limit=config.connections_limit)
        self._listeners: list[HttpListener] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._link: ControllerLink | None = None
        self.port = 0
        self.metrics_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.listen_host}:{self.port}"

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        self.port = await self._listen(self.router.handle, self.config.listen_host,
                                       self.config.listen_port)
        if self.config.metrics_port is not None:
            self.metrics_port = await self._listen(
                self.router.handle_metrics, self.config.metrics_host or self.config.listen_host,
                self.config.metrics_port)
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

    async def _listen(self, handler: Handler, host: str, port: int) -> int:
        listener = HttpListener(handler)
        try:
            bound = await listener.start(host, port, backlog=1024)
        except OSError as err:
            raise ConfigError(f"gateway: cannot listen on {host}:{port}: "
                              f"{err.strerror or err}") from None
        self._listeners.append(listener)
        return bound

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        for listener in self._listeners:
            await listener.stop(SHUTDOWN_GRACE_S)
        self._listeners.clear()
        self.router.close()
        if self._link is not None:
            await self._link.close()
            self._link = None


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
