"""`ReportGateway` keeps gateways' reports bounded, whoever calls it (any read token):
at most MAX_GATEWAYS gateway ids, a gateway silent for GATEWAY_STALE_S dropped, ids
and report sizes checked, and of a report only the routed deployments kept, once.
A real ControlService behind the error interceptor, called over loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from grpc import aio

from gearshift.controller.api.control_service import ControlService
from gearshift.controller.api.interceptors import ErrorInterceptor
from gearshift.controller.api.validation import MAX_DEPLOYMENTS_PER_REPORT
from gearshift.controller.ingest.fleet import FleetState
from gearshift.controller.ingest.gateway_reports import (
    GATEWAY_STALE_S,
    MAX_GATEWAY_ID_CHARS,
    MAX_GATEWAYS,
)
from gearshift.v1 import agent_pb2, control_pb2, control_pb2_grpc

T0 = 1_000_000.0


@dataclass
class Served:
    fleet: FleetState
    stub: control_pb2_grpc.ControlServiceStub
    now: list[float]


def _host(fleet: FleetState, host: str, *dep_ids: str) -> None:
    fleet.hello(agent_pb2.Hello(host_id=host, protocol_version=agent_pb2.PROTOCOL_VERSION_1), 1.0)
    report = agent_pb2.Report(seq=1)
    for port, dep_id in enumerate(dep_ids, start=8000):
        report.deployments.add(deployment_id=dep_id, model="m", engine="vllm",
                               phase=agent_pb2.DEPLOYMENT_PHASE_READY,
                               endpoint=f"http://10.0.0.1:{port}", served_model_name="m")
    fleet.report(host, report)


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    now = [T0]
    fleet = FleetState(clock=lambda: now[0])
    _host(fleet, "gpu-1", "d1", "d2")
    server = aio.server(interceptors=[ErrorInterceptor()])
    control_pb2_grpc.add_ControlServiceServicer_to_server(
        ControlService(fleet, controller_id="c", epoch=1, store_kind="sqlite"), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Served(fleet, control_pb2_grpc.ControlServiceStub(channel), now)
    finally:
        await server.stop(0)


def _report(gateway_id: str, *dep_ids: str) -> control_pb2.GatewayReport:
    return control_pb2.GatewayReport(gateway_id=gateway_id, deployments=[
        control_pb2.GatewayDeploymentStats(deployment_id=d, in_flight=1, requests_total=7)
        for d in dep_ids])


async def _refusal(stub: control_pb2_grpc.ControlServiceStub,
                   report: control_pb2.GatewayReport) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(aio.AioRpcError) as refused:
        await stub.ReportGateway(report)
    return refused.value.code(), refused.value.details() or ""


async def test_distinct_gateway_ids_beyond_the_cap_are_refused_naming_it(served: Served) -> None:
    for i in range(MAX_GATEWAYS):
        await served.stub.ReportGateway(_report(f"gw-{i}", "d1"))
    assert len(served.fleet.gateway_stats) == MAX_GATEWAYS
    for i in range(MAX_GATEWAYS, MAX_GATEWAYS + 20):
        code, details = await _refusal(served.stub, _report(f"gw-{i}", "d1"))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"at most {MAX_GATEWAYS} gateways (MAX_GATEWAYS)" in details
        assert f"'gw-{i}'" in details
    assert len(served.fleet.gateway_stats) == MAX_GATEWAYS
    # A gateway already kept goes on reporting at the cap.
    await served.stub.ReportGateway(_report("gw-0", "d1", "d2"))
    latest = served.fleet.gateway_stats.latest("gw-0")
    assert latest is not None and [d.deployment_id for d in latest.deployments] == ["d1", "d2"]


async def test_a_silent_gateway_is_pruned_and_makes_room(served: Served) -> None:
    for i in range(MAX_GATEWAYS):
        await served.stub.ReportGateway(_report(f"gw-{i}", "d1"))
    served.now[0] += GATEWAY_STALE_S * 2 / 3
    for i in range(10):  # these keep reporting; the others fall silent
        await served.stub.ReportGateway(_report(f"gw-{i}", "d1"))
    served.now[0] += GATEWAY_STALE_S * 2 / 3  # the silent ones are past GATEWAY_STALE_S
    await served.stub.ReportGateway(_report("gw-new", "d1"))
    stats = served.fleet.gateway_stats
    assert len(stats) == 11
    assert "gw-new" in stats and "gw-9" in stats and "gw-10" not in stats
    # The controller's housekeeping prunes too, with no report arriving.
    assert stats.prune(served.now[0] + GATEWAY_STALE_S + 1) == [
        *(f"gw-{i}" for i in range(10)), "gw-new"]
    assert len(stats) == 0


async def test_reports_from_ever_new_gateway_ids_keep_the_store_bounded(served: Served) -> None:
    # 1,200 distinct ids, 120 every 0.6 GATEWAY_STALE_S, each reporting once: all taken
    # (those silent for longer are dropped), and the store never holds more than the two
    # latest batches.
    sizes = []
    for batch in range(10):
        served.now[0] += GATEWAY_STALE_S * 0.6
        for i in range(120):
            await served.stub.ReportGateway(_report(f"gw-{batch}-{i}", "d1", "d2"))
            sizes.append(len(served.fleet.gateway_stats))
    assert max(sizes) == 240 <= MAX_GATEWAYS
    assert len(served.fleet.gateway_stats) == 240


@pytest.mark.parametrize("gateway_id", [
    "", "g" * (MAX_GATEWAY_ID_CHARS + 1), "gw\n1", "gw\x00", "\x1b[31mgw", "gw\u2028x",
    "x" * 100_000])
async def test_bad_gateway_ids_are_refused_naming_the_field(served: Served,
                                                            gateway_id: str) -> None:
    code, details = await _refusal(served.stub, _report(gateway_id, "d1"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("GatewayReport.gateway_id: expected 1 to "
                              f"{MAX_GATEWAY_ID_CHARS} printable characters")
    assert len(details) < 400 and "\n" not in details and "\x1b" not in details
    assert len(served.fleet.gateway_stats) == 0


async def test_good_gateway_ids_are_taken(served: Served) -> None:
    for gateway_id in ("g" * MAX_GATEWAY_ID_CHARS, "gpu-gw-1234", "passerelle é 2"):
        await served.stub.ReportGateway(_report(gateway_id, "d1"))
    assert len(served.fleet.gateway_stats) == 3


async def test_reports_naming_more_deployments_than_the_fleet_could_have_are_refused(
        served: Served) -> None:
    # One host: at most MAX_DEPLOYMENTS_PER_REPORT deployments in the whole fleet.
    too_many = [f"x{i}" for i in range(MAX_DEPLOYMENTS_PER_REPORT + 1)]
    code, details = await _refusal(served.stub, _report("gw", *too_many))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == (f"GatewayReport.deployments: at most {MAX_DEPLOYMENTS_PER_REPORT} (as "
                       f"many as the fleet's hosts could run), found {len(too_many)}")
    assert len(served.fleet.gateway_stats) == 0
    _host(served.fleet, "gpu-2", "d3")  # two hosts could run twice as many
    await served.stub.ReportGateway(_report("gw", *too_many))
    assert "gw" in served.fleet.gateway_stats


async def test_only_routed_deployments_are_kept_and_once_each(served: Served) -> None:
    unknown = [f"made-up-{i}" for i in range(200)]
    await served.stub.ReportGateway(_report("gw", "d1", *unknown, "d1", "d2", "d1"))
    latest = served.fleet.gateway_stats.latest("gw")
    assert latest is not None
    assert [(d.deployment_id, d.in_flight, d.requests_total) for d in latest.deployments] == [
        ("d1", 1, 7), ("d2", 1, 7)]
