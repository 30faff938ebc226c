"""The cost model of docs/cost-model.md: baselines to the cent, and each rule on small traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gearshift.policies.backtest import baseline_costs
from gearshift.policies.costmodel import (
    ModelReplay,
    delay_steps,
    rebuild_usd,
    replay_model,
    replicas,
)
from gearshift.policies.trace import read_trace

TRACES = Path(__file__).parent / "traces"
EXPECTED = json.loads((TRACES / "expected.json").read_text())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_static_baselines_match_expected_json_to_the_cent(name: str) -> None:
    trace = read_trace(TRACES / f"{name}.jsonl.gz")
    got = baseline_costs(trace)
    for baseline in ("static-vllm", "static-tensorrt-llm"):
        assert got[baseline]["cost_usd"] == EXPECTED[name][baseline]["cost_usd"], baseline
    lag = sum(replay_model(trace, m, {}).revision_lag_h for m in trace.series)
    assert round(lag, 2) == EXPECTED[name]["static-vllm"]["revision_lag_h"]


def test_replicas_delay_and_rebuild_follow_the_formulas(make_trace) -> None:
    assert replicas(10.0, 12.0, 0.2, 1) == 1  # 10*1.2/12 == 1 exactly: no round-up
    assert replicas(0.0, 10.0, 0.2, 2) == 2
    assert replicas(84.2, 10.0, 0.2, 1) == 11
    assert delay_steps(1800, 240, 300) == 7 and delay_steps(0, 60, 300) == 1
    trace = make_trace({"m": [50.0]})
    p = trace.profiles["m"]
    # 4 $/GPU-h * (1800 s * 8 GPUs + (240 + 600) s * 6 replicas * 8 GPUs) / 3600 + 150
    assert rebuild_usd(p, "tensorrt-llm", 50.0, price_per_gpu_hour=4.0, headroom=0.2,
                       overlap_s=600) == pytest.approx(4 * (14400 + 840 * 6 * 8) / 3600 + 150)


def test_a_switch_pays_one_rebuild_and_serves_the_target_after_the_delay(make_trace) -> None:
    trace = make_trace({"m": [50.0] * 10})  # vLLM 6 replicas, TensorRT-LLM 6 replicas
    out = replay_model(trace, "m", {0: "tensorrt-llm"})
    rebuild = rebuild_usd(trace.profiles["m"], "tensorrt-llm", 50.0, price_per_gpu_hour=4.0,
                          headroom=0.2, overlap_s=600)
    # 7 steps on vLLM (6 replicas) then 3 on TensorRT-LLM (ceil(60/11.6) = 6)
    gpu_hours = (7 * 6 + 3 * 6) * 8 * 300 / 3600
    assert out.gpu_hours == round(gpu_hours, 2)
    assert out.cost_usd == round(gpu_hours * 4.0 + rebuild, 2)
    assert out.accepted_steps == (0,)


def test_a_switch_during_a_switch_is_ignored_and_a_quick_return_is_a_flap(make_trace) -> None:
    trace = make_trace({"m": [50.0] * 400})
    out = replay_model(trace, "m", {0: "tensorrt-llm", 3: "vllm", 10: "vllm", 300: "tensorrt-llm"})
    assert out.accepted_steps == (0, 10, 300)  # step 3 falls inside the 7-step build
    assert out.flaps == 1  # back on vLLM 10 steps after leaving it; 300 is > 24 h after step 10


def test_revisions_rebuild_the_serving_engine_and_count_lag(make_trace) -> None:
    trace = make_trace({"m": [5.0] * 40}, revisions={"m": [2, 20]})
    on_vllm = replay_model(trace, "m", {})
    assert on_vllm.revision_lag_h == round(2 * 300 / 3600, 2)  # one step each
    on_trt = replay_model(trace, "m", {}, initial_engine="tensorrt-llm")
    assert on_trt.revision_lag_h == round(2 * 7 * 300 / 3600, 2)
    # a switch decided during a same-engine rebuild replaces it; lag ends when it completes
    replaced = replay_model(trace, "m", {2: "tensorrt-llm"})
    assert replaced.accepted_steps == (2,)
    assert replaced.revision_lag_h == round((7 + 7) * 300 / 3600, 2)


def test_sla_minutes_count_steps_served_by_an_engine_over_its_target(make_trace, profile_of) -> None:
    slow = profile_of(ttft_p99_ms={"vllm": 1200.0, "tensorrt-llm": 780.0})
    trace = make_trace({"m": [5.0] * 12}, profiles={"m": slow})
    assert replay_model(trace, "m", {}).sla_violation_min == 60.0
    assert replay_model(trace, "m", {0: "tensorrt-llm"}).sla_violation_min == 7 * 5.0


@pytest.mark.parametrize("revisions", [[], [0], [39], [2, 20], [3, 5, 9, 10, 16, 17, 36, 38],
                                       [1, 8, 15, 22, 29, 36], [0, 6, 7, 13, 14, 39]])
@pytest.mark.parametrize("engine", ["vllm", "tensorrt-llm"])
def test_a_replay_without_switches_sums_to_its_steps(make_trace, profile_of, revisions: list[int],
                                                     engine: str) -> None:
    """`replay_model` without switches (`ModelReplay.steps_unswitched`, the static baselines)
    leaves what stepping each step leaves: every figure of the outcome and the state."""
    slow = profile_of(ttft_p99_ms={"vllm": 1200.0, "tensorrt-llm": 780.0})
    rates = [0.0, 5.0, 13.7, 40.1, 2.2] * 8
    trace = make_trace({"m": rates}, profiles={"m": slow}, revisions={"m": revisions})
    stepped = ModelReplay(trace, "m", initial_engine=engine)
    for k in range(len(rates)):
        stepped.step(k)
    summed = ModelReplay(trace, "m", initial_engine=engine)
    summed.steps_unswitched(len(rates))
    assert summed.outcome() == stepped.outcome()
    assert replay_model(trace, "m", {}, initial_engine=engine) == stepped.outcome()
    assert (summed.serving, summed.pending) == (stepped.serving, stepped.pending)
    with pytest.raises(ValueError):
        stepped.steps_unswitched(len(rates))
