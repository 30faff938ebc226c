"""A host that is revoked, or forgotten for any other reason, takes its deployments out
of the routing table with it, and route watchers (gateways' WatchRoutes streams) get
the new table."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from gearshift.controller.ingest.fleet import FleetState
from gearshift.controller.store.persistence import Persistence
from gearshift.v1 import agent_pb2, control_pb2

READY = agent_pb2.DEPLOYMENT_PHASE_READY


def _join(fleet: FleetState, host: str, *deployments: tuple[str, str]) -> None:
    """Hello, then one report of ready deployments (deployment id, model)."""
    fleet.hello(agent_pb2.Hello(host_id=host, protocol_version=agent_pb2.PROTOCOL_VERSION_1), 1.0)
    report = agent_pb2.Report(seq=1)
    for port, (dep_id, model) in enumerate(deployments, start=8000):
        report.deployments.add(deployment_id=dep_id, model=model, engine="vllm", phase=READY,
                               endpoint=f"http://10.0.0.{len(host)}:{port}",
                               served_model_name=model)
    assert fleet.report(host, report)


def _routed(table: control_pb2.RoutingTable) -> dict[str, dict[str, tuple[str, float]]]:
    """model -> deployment id -> (host, weight)."""
    return {m.model: {e.deployment_id: (e.host_id, round(e.weight, 3)) for e in m.endpoints}
            for m in table.models}


def _fleet_of_two() -> FleetState:
    fleet = FleetState()
    _join(fleet, "gpu-1", ("a1", "m"), ("a2", "solo"))
    _join(fleet, "gpu-22", ("b1", "m"))
    assert _routed(fleet.routing_table()) == {
        "m": {"a1": ("gpu-1", 0.5), "b1": ("gpu-22", 0.5)}, "solo": {"a2": ("gpu-1", 1.0)}}
    return fleet


def test_a_removed_host_leaves_the_routing_table_and_the_version_changes() -> None:
    fleet = _fleet_of_two()
    before = fleet.routing_table().version

    assert fleet.remove_host("gpu-1") is True
    table = fleet.routing_table()
    assert _routed(table) == {"m": {"b1": ("gpu-22", 1.0)}}  # "solo" has no route left
    assert table.version > before and fleet.route_version == table.version
    assert "gpu-1" not in fleet.hosts
    assert "gpu-1" not in {h for h, _d, _ts in fleet.deployments_of("m")}
    assert fleet.remove_host("gpu-1") is False  # unknown now: nothing changes
    assert fleet.routing_table().version == table.version


async def test_route_watchers_get_the_table_without_a_removed_host_at_once() -> None:
    # In the event loop route changes are debounced; a revocation must not wait for it.
    fleet = _fleet_of_two()
    watcher = fleet.watch_routes()
    first = watcher.get_nowait()
    assert "gpu-1" in {e.host_id for m in first.models for e in m.endpoints}

    fleet.remove_host("gpu-1")
    pushed = watcher.get_nowait()  # no await: already queued
    assert pushed.version > first.version
    assert _routed(pushed) == {"m": {"b1": ("gpu-22", 1.0)}}


async def test_a_later_hello_of_a_removed_host_brings_no_route_back() -> None:
    # Refusing a revoked host's hello is the agent service's (`refuse_host`); should a
    # hello come through anyway, the host starts with no deployments, so no route.
    fleet = _fleet_of_two()
    fleet.remove_host("gpu-1")
    version = fleet.route_version
    fleet.hello(agent_pb2.Hello(host_id="gpu-1", protocol_version=agent_pb2.PROTOCOL_VERSION_1),
                1.0)
    assert fleet.route_version == version
    assert "gpu-1" not in {e.host_id for m in fleet.routing_table().models for e in m.endpoints}


@pytest.mark.parametrize("how", ["forget", "prune"])
async def test_a_forgotten_host_leaves_the_routing_table(how: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    now = [1000.0]
    fleet = FleetState(clock=lambda: now[0])
    _join(fleet, "gpu-1", ("a1", "m"))
    _join(fleet, "gpu-22", ("b1", "m"))
    watcher = fleet.watch_routes()
    first = watcher.get_nowait()
    if how == "forget":
        fleet.forget("gpu-1")
    else:  # gone for longer than the retention: the controller's housekeeping forgets it
        persistence = Persistence.open("", tmp_path, CollectorRegistry())
        try:
            fleet.disconnected("gpu-1", fleet.hosts["gpu-1"])
            now[0] += 8 * 86400
            assert persistence.prune_fleet(fleet, now[0]) == ["gpu-1"]  # gpu-22 is connected
        finally:
            persistence.close(fleet)
    table = fleet.routing_table()
    assert "gpu-1" not in {e.host_id for m in table.models for e in m.endpoints}
    assert table.version > first.version
