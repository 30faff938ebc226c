"""The gateway against a real gRPC controller on loopback (WatchRoutes, ReportGateway)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from gearshift.v1 import control_pb2

pytestmark = pytest.mark.timeout(30)


def proto_table(version: int, routes: dict[str, list[tuple[str, str, float, bool]]]
                ) -> control_pb2.RoutingTable:
    """routes: model → [(deployment_id, endpoint, weight, leaving)]."""
    return control_pb2.RoutingTable(version=version, models=[
        control_pb2.ModelRoute(model=m, endpoints=[
            control_pb2.RouteEndpoint(deployment_id=d, endpoint=e, weight=w, leaving=lv,
                                      engine="vllm", host_id="h1")
            for d, e, w, lv in eps])
        for m, eps in routes.items()])


async def eventually(cond: Callable[[], bool]) -> None:
    """Wait until `cond()` holds (the pytest timeout bounds the wait)."""
    while not cond():
        await asyncio.sleep(0.01)


async def served_by(http, gw, model: str = "llama") -> str:  # type: ignore[no-untyped-def]
    async with http.post(f"{gw.url}/v1/completions", json={"model": model}) as r:
        assert r.status == 200, await r.text()
        return str((await r.json())["served_by"])


async def test_table_from_controller_and_fail_static(controller, upstreams, gateways,
                                                     http) -> None:
    a = await upstreams("a")
    gw = await gateways(controller=controller.address, backoff_initial_s=0.02,
                        backoff_max_s=0.05)
    async with http.get(f"{gw.metrics_url}/readyz") as r:
        assert r.status == 503  # no table yet
    async with http.get(f"{gw.metrics_url}/healthz") as r:
        assert r.status == 200  # alive all the same
    await controller.tables.put(proto_table(1, {"llama": [("d-a", a.url, 1.0, False)]}))
    await eventually(lambda: gw.router.table.version == 1)
    assert await served_by(http, gw) == "a"

    await controller.stop()  # the controller goes away: keep serving from the last table
    await asyncio.sleep(0.2)  # several reconnect attempts fail meanwhile
    assert gw.router.table.version == 1
    assert await served_by(http, gw) == "a"
    async with http.get(f"{gw.metrics_url}/readyz") as r:
        assert r.status == 200


async def test_reconnects_after_stream_ends_and_takes_new_table(controller, upstreams,
                                                                gateways, http) -> None:
    a, b = await upstreams("a"), await upstreams("b")
    gw = await gateways(controller=controller.address, backoff_initial_s=0.02,
                        backoff_max_s=0.05)
    await controller.tables.put(proto_table(1, {"llama": [("d-a", a.url, 1.0, False)]}))
    await eventually(lambda: gw.router.table.version == 1)
    await controller.tables.put(None)  # the server ends the stream
    await eventually(lambda: controller.watchers >= 2)
    assert await served_by(http, gw) == "a"
    await controller.tables.put(proto_table(2, {"llama": [("d-a", a.url, 1.0, True),
                                                          ("d-b", b.url, 1.0, False)]}))
    await eventually(lambda: gw.router.table.version == 2)
    assert {await served_by(http, gw) for _ in range(10)} == {"b"}


async def test_reports_in_flight_per_deployment(controller, upstreams, gateways, http) -> None:
    a = await upstreams("a")
    gw = await gateways(controller=controller.address, report_interval_s=0.02)
    await controller.tables.put(proto_table(1, {"llama": [("d-a", a.url, 1.0, False)]}))
    await eventually(lambda: gw.router.table.version == 1)

    async def stream() -> bytes:
        async with http.post(f"{gw.url}/v1/completions",
                             json={"model": "llama", "stream": True}) as r:
            return await r.read()

    task = asyncio.create_task(stream())

    def reported_in_flight(n: int) -> bool:
        return any(r.gateway_id == gw.gateway_id and
                   [(d.deployment_id, d.in_flight) for d in r.deployments] == [("d-a", n)]
                   for r in controller.reports)

    await eventually(lambda: reported_in_flight(1))
    a.release.set()
    await task
    controller.reports.clear()
    await eventually(lambda: reported_in_flight(0))
    last = controller.reports[-1].deployments[0]
    assert (last.requests_total, last.errors_total) == (1, 0)


async def test_report_failures_are_not_fatal(upstreams, gateways, http) -> None:
    a = await upstreams("a")
    # nothing listens at the controller address: watch and reports fail, routing goes on
    gw = await gateways({"llama": [{"endpoint": a.url}]}, controller="127.0.0.1:1",
                        report_interval_s=0.02, backoff_initial_s=0.02, backoff_max_s=0.05)
    await asyncio.sleep(0.2)
    assert await served_by(http, gw) == "a"
