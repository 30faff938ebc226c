"""Three engines in the decision core and the backtest: the core chooses among vLLM,
TensorRT-LLM and SGLang; the backtest of a trace naming three engines has one
`static-<engine>` baseline per engine, to the cent of expected.json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gearshift.policies.backtest import run_backtest
from gearshift.policies.core import ModelState, decide
from gearshift.policies.costmodel import replay_model
from gearshift.policies.loader import load_policy_file
from gearshift.policies.signals import EngineFacts, ModelFacts, ModelHistory, compute_signals
from gearshift.policies.trace import read_trace

TRACES = Path(__file__).parent / "traces" / "three-engines"
EXPECTED = json.loads((TRACES / "expected.json").read_text())
EXAMPLES = Path(__file__).parents[3] / "policies" / "examples"
STEP_S = 300.0
T0 = 1_772_409_600.0  # 2026-03-02T00:00:00Z
DAY_S = 86400.0


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_baselines_name_every_engine_to_the_cent(name: str) -> None:
    trace = read_trace(TRACES / f"{name}.jsonl.gz")
    assert trace.engines == ("vllm", "tensorrt-llm", "sglang")
    result = run_backtest(load_policy_file(str(EXAMPLES / "default.yaml")), trace)
    assert result["baselines"] == {f"static-{e}": {"cost_usd": EXPECTED[name][f"static-{e}"]["cost_usd"]}
                                   for e in trace.engines}
    for e in trace.engines:
        lag = sum(replay_model(trace, m, {}, initial_engine=e).revision_lag_h for m in trace.series)
        assert round(lag, 2) == EXPECTED[name][f"static-{e}"]["revision_lag_h"], e
    assert result["summary"]["sla_violation_min"] <= EXPECTED[name]["oracle"]["sla_violation_min"]
    assert result["summary"]["cost_usd"] < min(b["cost_usd"] for b in result["baselines"].values())


def _facts(nvidia: bool) -> ModelFacts:
    engines = {
        "vllm": EngineFacts(capacity_rps=40.0, ttft_p99_ms=300.0, cold_start_s=60, build_s=0,
                            build_overhead_usd=0.0),
        "tensorrt-llm": EngineFacts(capacity_rps=44.0, ttft_p99_ms=250.0, cold_start_s=75,
                                    build_s=120, build_overhead_usd=60.0),
        "sglang": EngineFacts(capacity_rps=48.8, ttft_p99_ms=246.0, cold_start_s=90, build_s=0,
                              build_overhead_usd=0.0),
    }
    return ModelFacts(gpus_per_replica=1, sla_ttft_p99_ms=500.0, engines=engines, nvidia=nvidia,
                      price_per_gpu_hour=4.0)


@pytest.mark.parametrize("nvidia", [True, False])
def test_the_core_chooses_the_cheapest_of_three_engines(nvidia: bool) -> None:
    policy = load_policy_file(str(EXAMPLES / "default.yaml"))
    now = T0 + DAY_S
    rates = [300.0] * 400
    history = ModelHistory.of(T0 + np.arange(len(rates)) * STEP_S, rates, [], STEP_S)
    signals = {"m": compute_signals("m", history, _facts(nvidia), now, policy.signal_settings)}
    [d] = decide(policy, signals, {"m": ModelState(engine="vllm", since=T0 - 30 * DAY_S)}, now)
    assert (d.from_engine, d.to_engine) == ("vllm", "sglang")
    assert d.inputs["capacity_rps.sglang"] == 48.8
    refused = dict(d.alternatives).get("tensorrt-llm")
    assert refused == (None if nvidia else "TensorRT-LLM needs NVIDIA GPUs")
