"""No answer exceeds gRPC's message cap, over a real gRPC server and client with their
default 4 MiB caps: the fleet-sized lists page (by count and by bytes); the routing table
streams in parts, which the gateway puts back together.

The fleet here is 1,200 hosts x 8 deployments whose names and messages are as long as
validation lets them be (controller/api/validation.py): unpaged, its deployments would be
about 25 MB and its routing table over 4 MiB, as 10,000 hosts x 8 deployments of
ordinary names would be. Cost: about 10 s (building the fleet, then every page)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from grpc import aio

from gearshift.controller.api.control_service import ControlService
from gearshift.controller.api.interceptors import ErrorInterceptor
from gearshift.controller.api.paging import MAX_PAGE_SIZE, table_parts
from gearshift.controller.ingest.fleet import FleetState
from gearshift.gateway.routes import TableParts, table_from_proto
from gearshift.v1 import agent_pb2, control_pb2, control_pb2_grpc

HOSTS, PER_HOST, MODELS = 1_200, 8, 400
T0 = 1_000_000.0


def _fleet(hosts: int) -> FleetState:
    fleet = FleetState(clock=lambda: T0)
    for h in range(hosts):
        host = f"gpu-node-{h:05d}.us-east-1.internal"
        fleet.hello(agent_pb2.Hello(host_id=host, protocol_version=agent_pb2.PROTOCOL_VERSION_1,
                                    labels={"zone": "us-east-1a", "pool": "h100"}), 10.0)
        report = agent_pb2.Report(seq=1, interval_s=10.0)
        for i in range(PER_HOST):
            model = f"org/model-{(h * PER_HOST + i) % MODELS:04d}-" + "x" * 230
            d = report.deployments.add(
                deployment_id=f"dep-{h:05d}-{i}-" + "y" * 110, model=model,
                engine="vllm", phase=agent_pb2.DEPLOYMENT_PHASE_READY,
                endpoint=f"http://10.{h // 250}.{h % 250}.1:{8000 + i}", served_model_name=model,
                source="/models/" + "z" * 1000, revision="r" * 120, tensor_parallel_size=1,
                engine_version="0.11.0", engine_release="0.11", request_rate=3.0,
                message="m" * 2000)
            d.gpu_indices.append(i)
            d.ttft.present, d.ttft.p50_s, d.ttft.p99_s = True, 0.05, 0.2
        fleet.report(host, report)
    fleet.routing_table()
    return fleet


@pytest.fixture(scope="module")
def big_fleet() -> FleetState:
    return _fleet(HOSTS)


@pytest.fixture
async def stub(big_fleet: FleetState) -> AsyncIterator[control_pb2_grpc.ControlServiceStub]:
    server = aio.server(interceptors=[ErrorInterceptor()])  # gRPC's default caps
    control_pb2_grpc.add_ControlServiceServicer_to_server(
        ControlService(big_fleet, controller_id="c", epoch=1, store_kind="sqlite"), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield control_pb2_grpc.ControlServiceStub(channel)
    finally:
        await server.stop(0)


async def _all(fn: object, request: object, field: str) -> list[object]:
    items: list[object] = []
    pages = 0
    while True:
        resp = await fn(request, timeout=60)  # type: ignore[operator]
        items.extend(getattr(resp, field))
        pages += 1
        assert resp.ByteSize() < 4 * 2**20
        if not resp.next_page_token:
            return items
        request.page_token = resp.next_page_token  # type: ignore[attr-defined]
        assert pages < 1000


async def test_every_deployment_host_and_model_pages_under_the_cap(
        stub: control_pb2_grpc.ControlServiceStub) -> None:
    deps = await _all(stub.ListDeployments,
                      control_pb2.ListDeploymentsRequest(page_size=MAX_PAGE_SIZE), "deployments")
    assert len(deps) == HOSTS * PER_HOST
    ids = [d.report.deployment_id for d in deps]  # type: ignore[attr-defined]
    assert len(set(ids)) == len(ids)
    keys = [(d.report.model, d.host_id, d.report.deployment_id) for d in deps]  # type: ignore[attr-defined]
    assert keys == sorted(keys)  # the order of one unpaged answer
    hosts = await _all(stub.ListHosts, control_pb2.ListHostsRequest(), "hosts")
    assert len(hosts) == HOSTS
    models = await _all(stub.ListModels, control_pb2.ListModelsRequest(page_size=7), "models")
    assert len(models) == MODELS


async def test_a_bad_page_token_or_size_is_refused_naming_it(
        stub: control_pb2_grpc.ControlServiceStub) -> None:
    for request, needle in ((control_pb2.ListHostsRequest(page_token="not-ours"),
                             "ListHostsRequest.page_token: not a token"),
                            (control_pb2.ListDeploymentsRequest(page_size=-1),
                             "ListDeploymentsRequest.page_size: expected 0")):
        fn = stub.ListHosts if isinstance(request, control_pb2.ListHostsRequest) \
            else stub.ListDeployments
        with pytest.raises(aio.AioRpcError) as err:
            await fn(request, timeout=10)  # type: ignore[operator]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in (err.value.details() or "")


async def test_the_routing_table_streams_in_parts_the_gateway_reassembles(
        big_fleet: FleetState, stub: control_pb2_grpc.ControlServiceStub) -> None:
    whole = big_fleet.routing_table()
    assert whole.ByteSize() > 4 * 2**20  # one message would be refused
    call = stub.WatchRoutes(control_pb2.WatchRoutesRequest(gateway_id="gw-1"))
    parts = TableParts()
    table = None
    async for msg in call:
        assert msg.ByteSize() < 4 * 2**20
        table = parts.add(msg)
        if table is not None:
            break
    call.cancel()
    assert table is not None and table.version == whole.version
    routes = table_from_proto(table)
    assert len(routes.models) == MODELS
    assert sum(len(eps) for eps in routes.models.values()) == HOSTS * PER_HOST


def test_parts_of_an_older_version_are_dropped_and_a_newer_one_starts_over() -> None:
    table = control_pb2.RoutingTable(version=5)
    for m in range(6):
        table.models.add(model=f"m{m}").endpoints.add(deployment_id=f"d{m}",
                                                        endpoint=f"http://h:{m + 1}")
    parts = table_parts(table, max_bytes=40)
    assert len(parts) > 2 and all(p.parts == len(parts) for p in parts)
    newer = control_pb2.RoutingTable()
    newer.CopyFrom(table)
    newer.version = 6
    assembler = TableParts()
    assert assembler.add(parts[0]) is None
    later = table_parts(newer, max_bytes=40)
    assert assembler.add(later[0]) is None
    assert assembler.add(parts[1]) is None  # v5 after v6 began: dropped
    done = None
    for p in later[1:]:
        done = assembler.add(p)
    assert done is not None and done.version == 6 and len(done.models) == 6
    small = control_pb2.RoutingTable(version=7)
    assert table_parts(small) == [small] and assembler.add(small) is small
