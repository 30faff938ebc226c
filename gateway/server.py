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
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from aiohttp import web
from prometheus_client import CollectorRegistry

from gearshift.controller.credentials import TlsFiles, load_token, secure_channel
from gearshift.controller.errors import ConfigError
from gearshift.gateway.controller_link import (
    BACKOFF_INITIAL_S,
    BACKOFF_MAX_S,
    REPORT_INTERVAL_S,
    report_loop,
    watch_routes,
)
from gearshift.gateway.metrics import GatewayMetrics
from gearshift.gateway.proxy import UPSTREAM_CONNECTIONS_LIMIT, Router
from gearshift.gateway.routes import RoutingTable, load_routes_file

log = logging.getLogger(__name__)

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
            host, sep, cport = self.controller.rpartition(":")
            if not sep or not host or not cport.isdigit():
                raise ConfigError(f"gateway: --controller must be HOST:PORT, "
                                  f"got {self.controller!r}")
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
        self._runners: list[web.AppRunner] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._channel: grpc.aio.Channel | None = None
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
        app = self.router.make_app()
        self.port = await self._listen(app, self.config.listen_host, self.config.listen_port)
        if self.config.metrics_port is not None:
            mapp = web.Application()
            mapp.router.add_get("/metrics", self.router.metrics_handler)
            self.metrics_port = await self._listen(
                mapp, self.config.metrics_host or self.config.listen_host, self.config.metrics_port)
        if self.config.controller:
            # TLS files from $GEARSHIFT_TLS_*, token from $GEARSHIFT_TOKEN(_FILE): never argv.
            self._channel = secure_channel(self.config.controller, TlsFiles.from_env(),
                                           load_token(), aio=True)
            self._tasks.append(asyncio.create_task(watch_routes(
                self._channel, self.gateway_id, self.router.set_table,
                backoff_initial_s=self.config.backoff_initial_s,
                backoff_max_s=self.config.backoff_max_s)))
            self._tasks.append(asyncio.create_task(report_loop(
                self._channel, self.router, self.gateway_id, self.config.report_interval_s)))
        log.info("gateway %s listening on %s (routes from %s)", self.gateway_id, self.url,
                 self.config.controller or self.router.table.source)

    async def _listen(self, app: web.Application, host: str, port: int) -> int:
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
        await runner.setup()
        self._runners.append(runner)
        site = web.TCPSite(runner, host, port, backlog=1024)
        try:
            await site.start()
        except OSError as err:
            raise ConfigError(f"gateway: cannot listen on {host}:{port}: "
                              f"{err.strerror or err}") from None
        return int(runner.addresses[-1][1])

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


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
