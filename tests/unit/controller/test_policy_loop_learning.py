"""The live policy loop decides on what the controller learned: the capacity rule shared
with the blind backtest (measured, else priors or the default ratio) and the traffic
forecast, each cited in the decision and explained in plain words."""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gearshift.cli.explain import decision_report
from gearshift.controller.api.control_actions import decision_msg
from gearshift.controller.decisions.learning import CapacityLearner, Forecaster
from gearshift.controller.decisions.policy_loop import PolicyLoop, RateHistory
from gearshift.controller.decisions.review import DecisionReview
from gearshift.controller.decisions.store import DecisionStore
from gearshift.controller.ingest.fleet import FleetState
from gearshift.controller.moves.store import MigrationRepository
from gearshift.controller.store.database import Store, default_sqlite_url
from gearshift.controller.store.tables import DecisionRow, RollupRow
from gearshift.policies.core import DecisionStatus
from gearshift.v1 import agent_pb2

NOW = 1_773_014_400.0  # 2026-03-09T00:00:00Z
STEP_S = 300.0
DAY_S = 86400.0
GPU = "NVIDIA H100 80GB HBM3"
TRUE_CAPACITY_RPS = 10.0

POLICY = """\
apiVersion: gearshift.dev/v1
kind: EnginePolicy
metadata: {{name: live}}
spec:
  mode: dry-run
  rules:
    - {{name: sla, kind: sla-guard}}
    - {{name: cost, kind: expected-savings}}
  guardrails: {{minDwell: 0s}}
  cost: {{pricePerGpuHour: 4.0}}
  models:
    m:
      slaTtftP99Ms: 1000
      gpusPerReplica: 8
      engines:
        vllm: {{coldStart: 210s{vllm}}}
        tensorrt-llm: {{coldStart: 240s, build: 30m{trt}}}
{extra}"""


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(default_sqlite_url(tmp_path / "data"))
    yield s
    s.close()


def _fleet(rps: float) -> FleetState:
    """One host serving model m on vLLM at `rps`, within its SLA."""
    fleet = FleetState(clock=lambda: NOW)
    fleet.hello(agent_pb2.Hello(host_id="h1", protocol_version=agent_pb2.PROTOCOL_VERSION_1,
                                gpus=[agent_pb2.GpuInfo(index=i, model=GPU) for i in range(8)]), 1.0)
    report = agent_pb2.Report(seq=1)
    report.deployments.add(deployment_id="d1", model="m", engine="vllm", engine_version="0.11.0",
                           phase=agent_pb2.DEPLOYMENT_PHASE_READY, request_rate=rps,
                           metrics_present=True, tensor_parallel_size=8,
                           ttft=agent_pb2.Quantiles(present=True, p99_s=0.8))
    fleet.report("h1", report)
    return fleet


def _vllm_minutes() -> list[RollupRow]:
    """An hour of one vLLM replica from 10% to 130% of its capacity; p99 crosses 1 s at it."""
    rows = []
    for i in range(60):
        load = TRUE_CAPACITY_RPS * (0.1 + 1.2 * i / 59)
        rows.append(RollupRow(model="m", engine="vllm", engine_version="0.11.0", gpu_model=GPU,
                              minute=datetime.fromtimestamp(NOW - 3 * DAY_S + 60 * i, UTC),
                              reports=6, replicas=1, request_rate_mean=load, request_rate_max=load,
                              ttft_p99_s=0.1 + 0.9 * (load / TRUE_CAPACITY_RPS) ** 4,
                              itl_p99_s=0.02))
    return rows


def _loop(store: Store, rates: list[float], *, measured: bool = True, vllm: str = "",
          trt: str = "", extra: str = "",
          on_decision: Callable[[str, DecisionStatus], None] | None = None) -> PolicyLoop:
    """A live loop over `rates` (one per STEP_S, ending at NOW), vLLM measured or not."""
    history = RateHistory(STEP_S)
    for k, rps in enumerate(rates):
        history.sample(NOW - (len(rates) - k) * STEP_S, {"m": rps})
    learner = CapacityLearner(store)
    if measured:
        assert learner.observe(_vllm_minutes()) == 60
    decisions = DecisionStore(store.engine)
    loop = PolicyLoop(store, decisions, _fleet(rates[-1]), history, paused=lambda: False,
                      clock=lambda: NOW,
                      review=DecisionReview(decisions, MigrationRepository(store.engine),
                                            on_status=on_decision),
                      learner=learner, forecaster=Forecaster(history.arrays, STEP_S,
                                                             clock=lambda: NOW))
    loop.policies.apply(POLICY.format(vllm=vllm, trt=trt, extra=extra), "live.yaml", "test", "")
    return loop


def _only_decision(loop: PolicyLoop) -> DecisionRow:
    rows = loop.evaluate(NOW)
    assert len(rows) == 1, rows
    return rows[0]


def test_one_engine_measured_the_other_is_estimated_through_the_default_ratio(store: Store) -> None:
    row = _only_decision(_loop(store, [200.0] * 288 * 3))
    i = row.inputs
    assert (row.from_engine, row.to_engine, row.rule) == ("vllm", "tensorrt-llm", "cost")
    assert i["capacity_source.vllm"] == "measured"
    assert math.isclose(i["capacity_rps.vllm"], TRUE_CAPACITY_RPS, rel_tol=0.1)
    assert i["capacity_source.tensorrt-llm"] == "default-ratio"
    assert i["capacity_ratio_base.tensorrt-llm"] == "vllm"
    assert i["capacity_rps.tensorrt-llm"] == pytest.approx(i["capacity_ratio.tensorrt-llm"]
                                                          * i["capacity_rps.vllm"])
    assert i["capacity_ratio_low.tensorrt-llm"] < i["capacity_ratio.tensorrt-llm"] \
        < i["capacity_ratio_high.tensorrt-llm"]
    assert i["capacity_note.tensorrt-llm"].endswith(
        "tensorrt-llm not measured: no latency observed on it yet")
    assert i["net_savings_usd"] > i["margin_usd"]

    text = decision_report(decision_msg(row))
    assert "Where the figures come from" in text
    assert "capacity on tensorrt-llm" in text and "NOT MEASURED: a default" in text
    assert "no latency observed on it yet" in text  # why it is a default
    # The savings rule's test, stored as data and rendered from it.
    assert row.conditions and row.conditions[0]["signal"] == "net_savings_usd"
    assert row.conditions[0]["held"] is True and row.conditions[0]["unit"] == "USD"
    assert "tested: net_savings_usd = $" in text and ": held" in text


def test_policy_priors_give_the_ratio_to_the_measured_engine(store: Store) -> None:
    """Priors of 10 and 9 req/s: TensorRT-LLM is 10% slower than what vLLM measured, so no move;
    the same loop with the default ratio moves."""
    slower = _loop(store, [200.0] * 288 * 3, vllm=", capacityRps: 10", trt=", capacityRps: 9")
    assert slower.evaluate(NOW) == []
    facts = slower.model_facts("m", slower.policies.active()[1])  # type: ignore[index]
    assert facts is not None
    assert facts.citations["capacity_source.tensorrt-llm"] == "ratio-prior"
    assert facts.citations["capacity_ratio.tensorrt-llm"] == pytest.approx(0.9)


def test_nothing_measured_falls_back_to_the_priors_and_says_so(store: Store) -> None:
    loop = _loop(store, [200.0] * 288 * 3, measured=False, vllm=", capacityRps: 10",
                 trt=", capacityRps: 11.6")
    row = _only_decision(loop)
    i = row.inputs
    assert i["capacity_source.vllm"] == i["capacity_source.tensorrt-llm"] == "prior"
    assert (i["capacity_rps.vllm"], i["capacity_rps.tensorrt-llm"]) == (10, 11.6)
    assert "no latency observed" in i["capacity_note.vllm"]
    assert "NOT MEASURED: the policy's prior" in decision_report(decision_msg(row))


def _daily(days: int) -> list[float]:
    return [200.0 + 80.0 * math.sin(2 * math.pi * k / 288) for k in range(288 * days)]


def test_the_forecast_sets_the_traffic_level_of_live_decisions(store: Store) -> None:
    """Nine days of a daily cycle: the seasonal forecast drives the estimate, and the
    decision cites it."""
    row = _only_decision(_loop(store, _daily(9)))
    i = row.inputs
    assert i["forecast_status"] == "ok" and i["forecast_method"] == "seasonal-gbm"
    assert i["forecast_horizon_h"] == 168.0  # the policy's horizon, not a fixed one
    assert i["traffic_basis"] == "forecast"
    assert i["traffic_level_rps"] == i["forecast_sustained_rps"]
    assert i["traffic_scale"] == pytest.approx(i["forecast_sustained_rps"] / i["rps_sustained"])
    assert "the FORECAST sustained rate (seasonal-gbm" in decision_report(decision_msg(row))


def test_no_collection_runs_during_a_tick_and_the_collector_is_left_as_found(
        store: Store) -> None:
    """The tick's records die with it: the collector is off while it evaluates (a decision
    is observed inside), on again after it, and left off by a tick that found it off."""
    seen: list[bool] = []
    loop = _loop(store, _daily(9), on_decision=lambda rule, status: seen.append(gc.isenabled()))
    assert gc.isenabled()
    assert len(loop.evaluate(NOW)) == 1
    assert seen and not any(seen) and gc.isenabled()
    gc.disable()
    try:
        loop.evaluate(NOW)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_too_little_history_uses_the_observed_level_and_says_why(store: Store) -> None:
    loop = _loop(store, [200.0] * 8, extra="  signals: {minHistory: 30m}\n")  # 40 min of rates
    row = _only_decision(loop)
    i = row.inputs
    assert i["forecast_status"] == "insufficient_data"
    assert i["traffic_basis"] == "observed" and i["traffic_scale"] == 1.0
    assert i["traffic_level_rps"] == i["rps_sustained"] == 200.0
    assert "insufficient data" in i["traffic_note"]
    assert "the OBSERVED sustained rate (the forecast was not used: forecast insufficient_data" \
        in decision_report(decision_msg(row))
