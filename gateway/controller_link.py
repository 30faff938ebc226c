"""The gateway's link to the controller: the routing-table watch and the in-flight reports.

`watch_routes` follows `ControlService.WatchRoutes` and hands every table to a
callback. When the stream breaks it reconnects with exponential backoff and
jitter, and the gateway keeps serving from its last table (fail static).
`report_loop` sends per-deployment in-flight counts with `ReportGateway` every few
seconds; a failed report is logged and the loop goes on. With several controllers
(`ControllerLink`), both follow the leader: a follower's refusal names it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

import grpc

from gearshift.common.endpoints import ControllerEndpoints, leader_hint
from gearshift.gateway.proxy import Router
from gearshift.gateway.routes import RoutingTable, TableParts, table_from_proto
from gearshift.v1 import control_pb2, control_pb2_grpc

log = logging.getLogger(__name__)

BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 30.0
REPORT_INTERVAL_S = 5.0
REPORT_TIMEOUT_S = 3.0
FOLLOWER_RETRY_S = 1.0  # a follower answered: a leader is being elected, ask again soon


class ControllerLink:
    """Channels to the controllers at `addresses`; `channel()` is the one to use now."""

    def __init__(self, addresses: str | list[str],
                 open_channel: Callable[[str], grpc.aio.Channel]) -> None:
        self.endpoints = ControllerEndpoints(addresses)
        self._open = open_channel
        self._channels: dict[str, grpc.aio.Channel] = {}

    @classmethod
    def of(cls, channel: grpc.aio.Channel | ControllerLink) -> ControllerLink:
        if isinstance(channel, ControllerLink):
            return channel
        link = cls("controller:1", lambda _addr: channel)
        return link

    @property
    def address(self) -> str:
        return self.endpoints.current

    def channel(self) -> grpc.aio.Channel:
        addr = self.endpoints.current
        if addr not in self._channels:
            self._channels[addr] = self._open(addr)
        return self._channels[addr]

    def stub(self) -> control_pb2_grpc.ControlServiceStub:
        return control_pb2_grpc.ControlServiceStub(self.channel())

    def failed(self, err: BaseException | None) -> bool:
        """See `ControllerEndpoints.failed`: True when a leader was named (retry now)."""
        return self.endpoints.failed(err)

    def succeeded(self) -> None:
        self.endpoints.succeeded()

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


def next_backoff_s(attempt: int, rng: Callable[[], float] = random.random,
                   initial_s: float = BACKOFF_INITIAL_S, max_s: float = BACKOFF_MAX_S) -> float:
    """Delay before reconnect number `attempt` (0-based): exponential, capped, with full jitter
    over the upper half so gateways restarted together do not reconnect in lockstep."""
    ceiling = min(max_s, initial_s * (2 ** min(attempt, 30)))
    return ceiling * (0.5 + 0.5 * rng())


async def watch_routes(
    channel: grpc.aio.Channel | ControllerLink,
    gateway_id: str,
    on_table: Callable[[RoutingTable], None],
    backoff_initial_s: float = BACKOFF_INITIAL_S,
    backoff_max_s: float = BACKOFF_MAX_S,
) -> None:
    """Follow the controller's routing table forever (until cancelled)."""
    link = ControllerLink.of(channel)
    attempt = 0
    have_table = False
    while True:
        now_again = False
        try:
            call = link.stub().WatchRoutes(control_pb2.WatchRoutesRequest(gateway_id=gateway_id))
            parts = TableParts()  # a large fleet's table comes in parts
            async for msg in call:
                link.succeeded()
                whole = parts.add(msg)
                if whole is None:
                    continue
                table = table_from_proto(whole)
                on_table(table)
                if not have_table or attempt:
                    log.info("routing table v%d from the controller: %d models",
                             table.version, len(table.models))
                have_table = True
                attempt = 0
            reason = "stream ended"
            link.failed(None)
        except grpc.aio.AioRpcError as err:
            reason = f"{err.code().name}: {err.details()}"
            follower = leader_hint(err) is not None
            now_again = link.failed(err)
            if follower and not now_again:
                attempt = 0  # controllers are up; leadership is settling
                log.info("no leader yet (%s); asking again in %.0fs", reason, FOLLOWER_RETRY_S)
                await asyncio.sleep(FOLLOWER_RETRY_S * (0.5 + 0.5 * random.random()))
                continue
        except Exception as err:  # a bad message must not end the watch; log it and go on
            log.exception("routing table from the controller could not be applied")
            reason = f"{type(err).__name__}: {err}"
        if now_again:
            log.info("following the leader to %s for routes (%s)", link.address, reason)
            continue
        delay = next_backoff_s(attempt, initial_s=backoff_initial_s, max_s=backoff_max_s)
        if have_table:
            log.warning("controller route stream lost (%s); keeping the last routing table; "
                        "reconnecting in %.1fs", reason, delay)
        else:
            log.warning("no routing table from the controller yet (%s); retrying in %.1fs",
                        reason, delay)
        attempt += 1
        await asyncio.sleep(delay)


def build_report(router: Router, gateway_id: str) -> control_pb2.GatewayReport:
    """The `GatewayReport` for the router's counters right now."""
    return control_pb2.GatewayReport(
        gateway_id=gateway_id,
        deployments=[
            control_pb2.GatewayDeploymentStats(
                deployment_id=s.deployment_id, in_flight=max(0, s.in_flight),
                requests_total=s.requests_total, errors_total=s.errors_total)
            for s in router.deployment_stats()
        ],
    )


async def report_loop(channel: grpc.aio.Channel | ControllerLink, router: Router,
                      gateway_id: str, interval_s: float = REPORT_INTERVAL_S) -> None:
    """Send the router's per-deployment counters every `interval_s` (until cancelled)."""
    link = ControllerLink.of(channel)
    failing = False
    while True:
        await asyncio.sleep(interval_s)
        try:
            await link.stub().ReportGateway(build_report(router, gateway_id),
                                            timeout=REPORT_TIMEOUT_S)
            if failing:
                log.info("gateway reports reach the controller again")
            failing = False
        except grpc.aio.AioRpcError as err:
            link.failed(err)
            if not failing:
                log.warning("gateway report to the controller failed (%s: %s); will keep trying",
                            err.code().name, err.details())
            failing = True
