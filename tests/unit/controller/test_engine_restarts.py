"""Engine restarts as the controller sees them in reports: counted per engine and model,
and a deployment that restarts CRASH_LOOP_RESTARTS times within the window crash-loops."""

from __future__ import annotations

from gearshift.controller.ingest.engine_restarts import CRASH_LOOP_RESTARTS, CRASH_LOOP_WINDOW_S
from gearshift.controller.ingest.fleet import FleetState
from gearshift.v1 import agent_pb2


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def _report(fleet: FleetState, host: str, seq: int, restarts: dict[str, int],
            model: str = "llama", engine: str = "vllm") -> None:
    fleet.report(host, agent_pb2.Report(seq=seq, interval_s=1.0, deployments=[
        agent_pb2.DeploymentReport(deployment_id=d, model=model, engine=engine, restarts=n,
                                   phase=agent_pb2.DEPLOYMENT_PHASE_READY)
        for d, n in restarts.items()]))


def _fleet(clock: Clock, *hosts: str) -> FleetState:
    fleet = FleetState(clock=clock)
    for h in hosts:
        fleet.hello(agent_pb2.Hello(host_id=h), 1.0)
    return fleet


def test_increases_between_reports_are_restarts() -> None:
    clock = Clock()
    fleet = _fleet(clock, "h1", "h2")
    _report(fleet, "h1", 1, {"d1": 4, "d2": 0})  # first sight: what came before is not seen
    _report(fleet, "h2", 1, {"d3": 0}, engine="sglang")
    assert fleet.restarts.take() == {}
    _report(fleet, "h1", 2, {"d1": 6, "d2": 1})
    _report(fleet, "h2", 2, {"d3": 1}, engine="sglang")
    assert fleet.restarts.take() == {("vllm", "llama"): 3, ("sglang", "llama"): 1}
    assert fleet.restarts.take() == {}  # taken once
    _report(fleet, "h1", 3, {"d1": 0, "d2": 1})  # a new deployment under an old id
    assert fleet.restarts.take() == {}


def test_restarts_survive_a_reconnect() -> None:
    clock = Clock()
    fleet = _fleet(clock, "h1")
    _report(fleet, "h1", 1, {"d1": 0})
    fleet.hello(agent_pb2.Hello(host_id="h1"), 1.0)  # the agent reconnects (new stream)
    _report(fleet, "h1", 1, {"d1": 2})
    assert fleet.restarts.take() == {("vllm", "llama"): 2}


def test_a_crash_loop_is_enough_restarts_within_the_window() -> None:
    clock = Clock()
    fleet = _fleet(clock, "h1")
    seq = 1
    _report(fleet, "h1", seq, {"d1": 0, "d2": 0})
    for n in range(1, CRASH_LOOP_RESTARTS + 1):
        clock.t += 60
        seq += 1
        _report(fleet, "h1", seq, {"d1": n, "d2": 1})  # d2 restarted once only
        looping = fleet.restarts.crash_looping(clock.t)
        assert looping == ({("vllm", "llama"): 1} if n == CRASH_LOOP_RESTARTS else {}), n
    clock.t += CRASH_LOOP_WINDOW_S  # the oldest restarts leave the window
    assert fleet.restarts.crash_looping(clock.t) == {}


def test_restarts_spread_wider_than_the_window_are_no_crash_loop() -> None:
    clock = Clock()
    fleet = _fleet(clock, "h1")
    _report(fleet, "h1", 1, {"d1": 0})
    for n in range(1, 2 * CRASH_LOOP_RESTARTS):
        clock.t += CRASH_LOOP_WINDOW_S / (CRASH_LOOP_RESTARTS - 1) + 1
        _report(fleet, "h1", n + 1, {"d1": n})
        assert fleet.restarts.crash_looping(clock.t) == {}


def test_a_forgotten_host_no_longer_crash_loops() -> None:
    clock = Clock()
    fleet = _fleet(clock, "h1")
    _report(fleet, "h1", 1, {"d1": 0})
    _report(fleet, "h1", 2, {"d1": CRASH_LOOP_RESTARTS})
    assert fleet.restarts.crash_looping(clock.t) == {("vllm", "llama"): 1}
    fleet.forget("h1")
    assert fleet.restarts.crash_looping(clock.t) == {}
