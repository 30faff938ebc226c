"""Why a model got no decision: `gearshift decisions evaluate` (EvaluateNow, a real client
against a real server over loopback) says it per model, from the decision core's own
reason; the live loop logs a model's reason once, when it changes, not at every tick."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from grpc import aio

from gearshift.cli.decisions import evaluate_summary
from gearshift.controller.api.control_service import ControlService
from gearshift.controller.decisions.policy_loop import PolicyLoop, RateHistory
from gearshift.controller.decisions.store import DecisionStore
from gearshift.controller.ingest.fleet import FleetState
from gearshift.controller.store.database import Store, default_sqlite_url
from gearshift.controller.store.tables import DecisionRow
from gearshift.policies.core import DecisionStatus
from gearshift.v1 import agent_pb2, control_pb2, control_pb2_grpc

NOW = 1_773_014_400.0  # 2026-03-09T00:00:00Z
STEP_S = 60.0
MODEL = "qwen3-8b"

POLICY = """\
apiVersion: gearshift.dev/v1
kind: EnginePolicy
metadata: {{name: live}}
spec:
  mode: dry-run
  signals: {{minHistory: 1h}}
  rules:
    - {{name: to-trt, kind: static, prefer: tensorrt-llm}}
  guardrails: {{minDwell: 0s, cooldown: {cooldown}}}
  cost: {{pricePerGpuHour: 4.0}}
  models:
    {model}:
      gpusPerReplica: 1
      engines:
        vllm: {{coldStart: 210s, capacityRps: 10}}
        tensorrt-llm: {{coldStart: 240s, build: 30m, capacityRps: 12}}
"""


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(default_sqlite_url(tmp_path / "data"))
    yield s
    s.close()


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _loop(store: Store, clock: Clock, history_s: float, cooldown: str = "0s") -> PolicyLoop:
    """Model qwen3-8b ready on vLLM, `history_s` of traffic sampled before `clock.now`."""
    fleet = FleetState(clock=lambda: NOW - 86400.0)
    fleet.hello(agent_pb2.Hello(host_id="h1", protocol_version=agent_pb2.PROTOCOL_VERSION_1,
                                gpus=[agent_pb2.GpuInfo(index=0, model="NVIDIA H100 80GB HBM3")]), 1.0)
    report = agent_pb2.Report(seq=1)
    report.deployments.add(deployment_id="d1", model=MODEL, engine="vllm",
                           phase=agent_pb2.DEPLOYMENT_PHASE_READY, request_rate=5.0)
    fleet.report("h1", report)
    history = RateHistory(STEP_S)
    n = int(history_s // STEP_S)
    history.extend(MODEL, [clock.now - history_s + i * STEP_S for i in range(n)], [5.0] * n)
    loop = PolicyLoop(store, DecisionStore(store.engine), fleet, history, paused=lambda: False,
                      clock=clock)
    loop.policies.apply(POLICY.format(cooldown=cooldown, model=MODEL), "test", "tester", "")
    return loop


async def _evaluate_now(loop: PolicyLoop) -> control_pb2.EvaluateNowResponse:
    control = ControlService(loop.fleet, controller_id="me", epoch=0, store_kind="sqlite",
                             decisions=loop.decisions, policy_loop=loop)
    server = aio.server()
    control_pb2_grpc.add_ControlServiceServicer_to_server(control, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = control_pb2_grpc.ControlServiceStub(channel)
            return await stub.EvaluateNow(control_pb2.EvaluateNowRequest())
    finally:
        await server.stop(0)


async def test_evaluate_now_says_history_is_short_and_how_short(store: Store) -> None:
    loop = _loop(store, Clock(NOW), history_s=12 * 60.0)
    resp = await _evaluate_now(loop)
    assert resp.message == "0 new decision(s)" and not resp.decisions
    [held] = resp.no_decision
    assert (held.model, held.reason) == (MODEL, "insufficient_history")
    assert held.detail == "insufficient history (12 min of 1 h minHistory)"
    assert evaluate_summary(resp) == ("0 new decision(s); no decision for 1 model(s): qwen3-8b: "
                                      "insufficient history (12 min of 1 h minHistory)")


async def test_evaluate_now_says_a_cooldown_holds_the_move_and_until_when(store: Store) -> None:
    switched = NOW - 3600.0
    DecisionStore(store.engine).add_decision(DecisionRow(
        created_at=datetime.fromtimestamp(switched, UTC), model=MODEL, from_engine="tensorrt-llm",
        to_engine="vllm", rule="r", mode="auto", status=DecisionStatus.DONE))
    loop = _loop(store, Clock(NOW), history_s=2 * 3600.0, cooldown="6h")
    resp = await _evaluate_now(loop)
    assert not resp.decisions
    [held] = resp.no_decision
    assert (held.model, held.reason) == (MODEL, "cooldown")
    assert held.until.ToSeconds() == int(switched + 6 * 3600.0)
    assert held.detail == ("cooldown until 2026-03-09T05:00:00Z (last switch 1 h ago, "
                           "cooldown 6 h)")


def test_the_live_loop_logs_a_reason_once_and_again_when_it_changes(
        store: Store, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock(NOW)
    loop = _loop(store, clock, history_s=12 * 60.0)
    caplog.set_level(logging.INFO, logger="gearshift.controller.decisions.policy_loop")
    for _ in range(5):  # five ticks, one reason: one line
        clock.now += STEP_S
        assert loop.evaluate() == []
    lines = [r.getMessage() for r in caplog.records if "no decision" in r.getMessage()]
    assert lines == [f"model {MODEL}: no decision: insufficient history (13 min of 1 h "
                     "minHistory)"]
    # Paused: nothing evaluated, nothing logged, nothing forgotten.
    caplog.clear()
    loop.paused = lambda: True
    assert loop.evaluate() == [] and not caplog.records
    loop.paused = lambda: False
    # A new reason (a freeze) is logged once more.
    loop.policies.apply(POLICY.format(cooldown="0s", model=MODEL).replace(
        "cooldown: 0s}", "cooldown: 0s, freezes: [qwen3-*]}"), "test", "tester", "")
    for _ in range(3):
        loop.evaluate()
    lines = [r.getMessage() for r in caplog.records if "no decision" in r.getMessage()]
    assert lines == [f"model {MODEL}: no decision: frozen by the policy's freeze 'qwen3-*'"]
