"""FleetState's incremental views (counts, per-model index, routes) agree with the fleet."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gearshift.controller.ingest.fleet import FleetState
from gearshift.v1 import agent_pb2, control_pb2

READY = agent_pb2.DEPLOYMENT_PHASE_READY
DRAINING = agent_pb2.DEPLOYMENT_PHASE_DRAINING
STARTING = agent_pb2.DEPLOYMENT_PHASE_STARTING
WAIT_LIMIT_S = 30.0  # generous bound for waiting on the event loop (never asserted)


def _hello(fleet: FleetState, host: str) -> None:
    fleet.hello(agent_pb2.Hello(host_id=host, protocol_version=agent_pb2.PROTOCOL_VERSION_1), 1.0)


def _report(fleet: FleetState, host: str, seq: int,
            *deps: tuple[str, str, int] | tuple[str, str, int, str, str]) -> None:
    r = agent_pb2.Report(seq=seq)
    for dep in deps:
        dep_id, model, phase = dep[:3]
        engine, endpoint = dep[3:] if len(dep) == 5 else ("vllm", f"http://{host}:{seq}")
        # Rates and metrics vary with the report and the deployment (for model_rates).
        r.deployments.add(deployment_id=dep_id, model=model, engine=engine, phase=phase,
                          endpoint=endpoint, served_model_name=model, request_rate=seq + 0.5,
                          metrics_present=not dep_id.endswith("2"))
    fleet.report(host, r)


def _rates(fleet: FleetState) -> dict[str, float]:
    """Request rate per model recomputed from every deployment: the ready ones with metrics."""
    out: dict[str, float] = {}
    for _h, d, _ts in fleet.deployments():
        if d.phase == READY and d.metrics_present:
            out[d.model] = out.get(d.model, 0.0) + d.request_rate
    return out


def _recount(fleet: FleetState) -> dict[tuple[str, int], int]:
    return dict(Counter((d.engine, d.phase) for _h, d, _ts in fleet.deployments()))


def _expected_routes(fleet: FleetState) -> dict[str, dict[str, tuple[float, bool]]]:
    """The routing table recomputed from scratch: ready and draining deployments with an
    endpoint; the ready ones share the weight equally."""
    by_model: dict[str, list[agent_pb2.DeploymentReport]] = {}
    for _h, d, _ts in fleet.deployments():
        if d.endpoint and d.phase in (READY, DRAINING):
            by_model.setdefault(d.model, []).append(d)
    out = {}
    for model, deps in by_model.items():
        ready = sum(1 for d in deps if d.phase == READY)
        out[model] = {d.deployment_id: ((round(1.0 / ready, 3) if d.phase == READY else 0.0),
                                        d.phase == DRAINING) for d in deps}
    return out


def _routes(table: control_pb2.RoutingTable) -> dict[str, dict[str, tuple[float, bool]]]:
    return {m.model: {e.deployment_id: (round(e.weight, 3), e.leaving) for e in m.endpoints}
            for m in table.models}


def test_deployment_counts_follow_reports_and_survive_a_reconnect() -> None:
    fleet = FleetState()
    _hello(fleet, "a")
    _hello(fleet, "b")
    _report(fleet, "a", 1, ("a1", "m", READY), ("a2", "n", STARTING, "tensorrt-llm", ""))
    _report(fleet, "b", 1, ("b1", "m", READY))
    assert fleet.deployment_counts() == {("vllm", READY): 2, ("tensorrt-llm", STARTING): 1}
    _report(fleet, "a", 2, ("a1", "m", DRAINING), ("a2", "n", READY, "tensorrt-llm", "http://x"))
    assert fleet.deployment_counts() == {("vllm", DRAINING): 1, ("vllm", READY): 1,
                                         ("tensorrt-llm", READY): 1}
    _hello(fleet, "a")  # reconnect: the last known deployments stay until the next report
    assert fleet.deployment_counts() == _recount(fleet)
    _report(fleet, "b", 2)  # b's deployment is gone
    assert fleet.deployment_counts() == {("vllm", DRAINING): 1, ("tensorrt-llm", READY): 1}
    assert fleet.deployment_counts() == _recount(fleet)


def test_host_state_counts() -> None:
    now = [1000.0]
    fleet = FleetState(clock=lambda: now[0])
    _hello(fleet, "a")
    _hello(fleet, "b")
    _report(fleet, "a", 1, ("a1", "m", READY))
    assert fleet.host_state_counts() == {control_pb2.HOST_STATE_CONNECTED: 1,
                                         control_pb2.HOST_STATE_JOINING: 1}
    now[0] += 3.5  # three 1 s intervals without a report
    assert fleet.host_state_counts() == {control_pb2.HOST_STATE_UNREACHABLE: 2}


def test_deployments_of_one_model() -> None:
    fleet = FleetState()
    for host in ("a", "b", "c"):
        _hello(fleet, host)
    _report(fleet, "a", 1, ("a1", "m", READY), ("a2", "n", READY))
    _report(fleet, "b", 1, ("b1", "n", STARTING))
    _report(fleet, "c", 1, ("c1", "m", DRAINING))
    assert [(h, d.deployment_id) for h, d, _ts in fleet.deployments_of("m")] == [
        ("a", "a1"), ("c", "c1")]
    _report(fleet, "a", 2, ("a2", "n", READY))  # a1 went away
    assert [d.deployment_id for _h, d, _ts in fleet.deployments_of("m")] == ["c1"]
    assert [d.deployment_id for _h, d, _ts in fleet.deployments_of("n")] == ["a2", "b1"]
    assert fleet.deployments_of("unknown") == []


def test_route_version_moves_only_when_routes_change() -> None:
    fleet = FleetState()
    _hello(fleet, "a")
    v0 = fleet.route_version
    _report(fleet, "a", 1, ("a1", "m", STARTING))
    assert fleet.route_version == v0  # nothing routable yet
    _report(fleet, "a", 2, ("a1", "m", READY))
    v1 = fleet.route_version
    assert v1 > v0 and fleet.routing_table().version == v1
    _report(fleet, "a", 3, ("a1", "m", READY))  # endpoint changes with seq in this builder
    assert fleet.route_version > v1


async def test_changes_reach_watchers_through_the_loop_without_a_read() -> None:
    fleet = FleetState()
    _hello(fleet, "a")
    q = fleet.watch_routes()
    await q.get()
    _report(fleet, "a", 1, ("a1", "m", READY))
    table = await asyncio.wait_for(q.get(), WAIT_LIMIT_S)  # the debounced recomputation
    assert _routes(table) == {"m": {"a1": (1.0, False)}}
    fleet.unwatch_routes(q)


_deployment = st.tuples(st.sampled_from(["d1", "d2", "d3", "d4"]), st.sampled_from(["m", "n"]),
                        st.sampled_from([READY, DRAINING, STARTING]), st.sampled_from(["", "http://e"]))
_step = st.tuples(st.sampled_from(["a", "b", "c"]), st.lists(_deployment, max_size=4))


@settings(max_examples=60, deadline=None)
@given(st.lists(_step, min_size=1, max_size=25))
def test_incremental_views_match_a_recomputation(steps: list) -> None:  # type: ignore[type-arg]
    fleet = FleetState()
    seqs: dict[str, int] = {}
    for host, deps in steps:
        if host not in seqs:
            _hello(fleet, host)
        seqs[host] = seqs.get(host, 0) + 1
        unique = {f"{host}-{d[0]}": d for d in deps}  # deployment ids are unique in the fleet
        _report(fleet, host, seqs[host],
                *((dep_id, model, phase, "vllm", endpoint)
                  for dep_id, (_d, model, phase, endpoint) in unique.items()))
        assert fleet.deployment_counts() == _recount(fleet)
        assert _routes(fleet.routing_table()) == _expected_routes(fleet)
        assert fleet.model_names() == {d.model for _h, d, _ts in fleet.deployments()}
        assert fleet.model_rates() == pytest.approx(_rates(fleet))
        for model in ("m", "n"):
            assert sorted(d.deployment_id for _h, d, _ts in fleet.deployments_of(model)) == sorted(
                d.deployment_id for _h, d, _ts in fleet.deployments() if d.model == model)


def test_kept_deployments_read_back_as_reported_and_cannot_be_changed_through_a_read() -> None:
    now = [1000.0]
    fleet = FleetState(clock=lambda: now[0])
    _hello(fleet, "h")
    r = agent_pb2.Report(seq=1)
    for dep_id, model in (("d1", "m1"), ("d2", "m2"), ("d3", "m1")):
        d = r.deployments.add(deployment_id=dep_id, model=model, engine="vllm", phase=READY,
                              endpoint=f"http://h:{dep_id}", request_rate=2.5, restarts=0)
        d.ttft.present, d.ttft.p99_s = True, 0.25
    fleet.report("h", r)
    entry = fleet.hosts["h"]
    assert list(entry.deployments) == ["d1", "d2", "d3"] and len(entry.deployments) == 3
    assert entry.deployments["d2"] == r.deployments[1]  # every field, the quantiles too
    assert [d.deployment_id for _h, d, _ts in fleet.deployments_of("m1")] == ["d1", "d3"]
    assert {ts for _h, _d, ts in fleet.deployments()} == {1000.0}
    assert entry.deployment_ts == {"d1": 1000.0, "d2": 1000.0, "d3": 1000.0}
    entry.deployments["d1"].request_rate = 99.0  # a read is a copy
    assert entry.deployments["d1"].request_rate == 2.5
    assert "d4" not in entry.deployments and entry.deployments.get("d4") is None
    # The next report replaces them all, with its own time.
    now[0] = 1010.0
    r2 = agent_pb2.Report(seq=2)
    r2.deployments.add(deployment_id="d2", model="m2", engine="vllm", phase=READY, restarts=2)
    fleet.report("h", r2)
    assert list(entry.deployments) == ["d2"]
    assert entry.deployment_ts == {"d2": 1010.0}
    assert fleet.restarts.take() == {("vllm", "m2"): 2}  # counted against the kept report


def test_a_host_keeps_its_hello_and_the_latest_reported_gpus() -> None:
    fleet = FleetState(clock=lambda: 100.0)
    hello = agent_pb2.Hello(host_id="h1", agent_version="1.2", labels={"zone": "a"},
                            protocol_version=agent_pb2.PROTOCOL_VERSION_1)
    hello.gpus.add(index=0, model="NVIDIA H100", memory_total_bytes=80 << 30)
    entry = fleet.hello(hello, 1.0)
    hello.labels["zone"] = "changed"  # the caller's message is not held
    assert (entry.host_id, entry.hello.agent_version, dict(entry.hello.labels)) == (
        "h1", "1.2", {"zone": "a"})
    assert [(g.index, g.model) for g in entry.gpus] == [(0, "NVIDIA H100")]
    assert entry.gpu_model == "NVIDIA H100"
    entry.hello.labels["zone"] = "b"  # a reader's copy: changing it changes nothing
    assert entry.hello.labels["zone"] == "a"

    r = agent_pb2.Report(seq=1)
    fleet.report("h1", r)  # no GPUs in this report: the hello's stand
    assert [g.model for g in entry.gpus] == ["NVIDIA H100"]
    r = agent_pb2.Report(seq=2)
    r.gpus.add(index=0, model="NVIDIA H200", utilization=0.5)
    r.gpus.add(index=1, model="NVIDIA H200")
    fleet.report("h1", r)
    assert [(g.index, g.model, g.utilization) for g in entry.gpus] == [
        (0, "NVIDIA H200", 0.5), (1, "NVIDIA H200", 0.0)]
    assert entry.gpu_model == "NVIDIA H200"
    assert [g.model for g in entry.hello.gpus] == ["NVIDIA H100"]  # the hello as received
