"""The routing table the controller derives from agents' reports."""

from __future__ import annotations

from gearshift.controller.ingest.fleet import FleetState
from gearshift.v1 import agent_pb2, control_pb2

READY = agent_pb2.DEPLOYMENT_PHASE_READY
DRAINING = agent_pb2.DEPLOYMENT_PHASE_DRAINING
STARTING = agent_pb2.DEPLOYMENT_PHASE_STARTING


def _hello(fleet: FleetState, host: str) -> None:
    fleet.hello(agent_pb2.Hello(host_id=host, protocol_version=agent_pb2.PROTOCOL_VERSION_1), 1.0)


def _report(fleet: FleetState, host: str, seq: int, *deps: tuple[str, str, int]) -> None:
    r = agent_pb2.Report(seq=seq)
    for dep_id, model, phase in deps:
        r.deployments.add(deployment_id=dep_id, model=model, engine="vllm", phase=phase,
                          endpoint=f"http://127.0.0.1:{1000 + seq}", served_model_name=model)
    fleet.report(host, r)


def _routes(table: control_pb2.RoutingTable) -> dict[str, dict[str, tuple[float, bool]]]:
    return {m.model: {e.deployment_id: (round(e.weight, 3), e.leaving) for e in m.endpoints}
            for m in table.models}


def test_ready_and_draining_deployments_are_routed_with_normalised_weights() -> None:
    fleet = FleetState()
    _hello(fleet, "a")
    _hello(fleet, "b")
    _report(fleet, "a", 1, ("a1", "m", READY), ("a2", "n", STARTING))
    _report(fleet, "b", 1, ("b1", "m", READY))
    t1 = fleet.routing_table()
    assert _routes(t1) == {"m": {"a1": (0.5, False), "b1": (0.5, False)}}

    _report(fleet, "b", 2, ("b1", "m", DRAINING))
    t2 = fleet.routing_table()
    assert _routes(t2) == {"m": {"a1": (1.0, False), "b1": (0.0, True)}}
    assert t2.version > t1.version

    _report(fleet, "a", 2, ("a1", "m", READY), ("a2", "n", READY))
    assert set(_routes(fleet.routing_table())) == {"m", "n"}


def test_unchanged_reports_keep_the_table_version() -> None:
    fleet = FleetState()
    _hello(fleet, "a")
    _report(fleet, "a", 1, ("a1", "m", READY))
    v = fleet.routing_table().version
    r = agent_pb2.Report(seq=2)
    r.deployments.add().CopyFrom(fleet.hosts["a"].deployments["a1"])
    r.deployments[0].request_rate = 99.0  # figures change; routes do not
    fleet.report("a", r)
    assert fleet.routing_table().version == v


def test_route_override_sets_shares_and_a_gone_deployment_leaves_the_table() -> None:
    fleet = FleetState()
    _hello(fleet, "a")
    _report(fleet, "a", 1, ("old", "m", READY), ("new", "m", READY))

    def canary(model: str, eps: list[control_pb2.RouteEndpoint]) -> list[control_pb2.RouteEndpoint]:
        for e in eps:
            e.weight = 0.25 if e.deployment_id == "new" else 0.75
        return eps

    fleet.route_with(canary)
    fleet.refresh_routes({"m"})
    assert _routes(fleet.routing_table()) == {"m": {"new": (0.25, False), "old": (0.75, False)}}
    _report(fleet, "a", 2, ("new", "m", READY))
    assert _routes(fleet.routing_table()) == {"m": {"new": (1.0, False)}}
    _report(fleet, "a", 3)
    assert _routes(fleet.routing_table()) == {}


async def test_watchers_get_the_current_table_then_changes() -> None:
    fleet = FleetState()
    _hello(fleet, "a")
    q = fleet.watch_routes()
    first = await q.get()
    _report(fleet, "a", 1, ("a1", "m", READY))
    fleet.routing_table()  # a read forces the pending recomputation
    second = await q.get()
    assert second.version > first.version and _routes(second) == {"m": {"a1": (1.0, False)}}
    fleet.unwatch_routes(q)


def test_a_host_is_joining_until_its_first_report() -> None:
    now = [1000.0]
    fleet = FleetState(clock=lambda: now[0])
    _hello(fleet, "a")
    assert fleet.host_state("a") == control_pb2.HOST_STATE_JOINING  # deployments not known yet
    _report(fleet, "a", 1, ("a1", "m", READY))
    assert fleet.host_state("a") == control_pb2.HOST_STATE_CONNECTED
    _hello(fleet, "b")
    now[0] += 3.5  # three 1 s intervals without the first report
    assert fleet.host_state("b") == control_pb2.HOST_STATE_UNREACHABLE
