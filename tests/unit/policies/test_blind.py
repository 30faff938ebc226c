"""Blind backtest: the documented latency model, a policy path that never reads the
header's capacities, decisions that cite what they learned, and the quality target."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from gearshift.cli.policy_cmds import policy as policy_cli
from gearshift.policies import blind
from gearshift.policies.backtest import run_backtest, simulate
from gearshift.policies.blind import LatencyCurve, LatencyWorld, blind_view
from gearshift.policies.loader import load_policy, load_policy_file
from gearshift.policies.trace import read_trace

from .conftest import policy_text

TRACES = Path(__file__).parent / "traces"
EXAMPLES = Path(__file__).parents[3] / "policies" / "examples"
BENCH = Path(__file__).parents[3] / "bench" / "blind.py"
SINGLE_MODEL_TRACES = ["bursty-8b", "ramp-70b", "rnd-churn-70b", "steady-70b", "weekly-churn-70b"]


@pytest.fixture(scope="module")
def default() -> Any:
    return load_policy_file(str(EXAMPLES / "default.yaml"))


@pytest.fixture(scope="module")
def steady() -> Any:
    return read_trace(TRACES / "steady-70b.jsonl.gz")


def test_the_latency_model_is_documented() -> None:
    doc = blind.__doc__ or ""
    for words in ("p99(rho)", "rho_op = 1 / (1 + headroom)", "SLA at rho = 1", "seed"):
        assert words in doc


def test_curve_meets_the_sla_at_capacity_and_the_header_at_operating_load() -> None:
    curve = LatencyCurve.calibrate(1000.0, 900.0, 1 / 1.2)
    assert curve.p99_ms(1.0) == pytest.approx(1000.0)
    assert curve.p99_ms(1 / 1.2) == pytest.approx(900.0)
    breaking = LatencyCurve.calibrate(500.0, 700.0, 1 / 1.2)  # an engine over its SLA
    assert breaking.p99_ms(1 / 1.2) == pytest.approx(700.0) and breaking.p99_ms(0.5) < 700.0


@given(sla=st.floats(50, 5000), share=st.floats(0.05, 1.5), headroom=st.floats(0.0, 2.0),
       a=st.floats(0.0, 1.2), b=st.floats(0.0, 1.2))
def test_latency_is_monotone_in_load(sla: float, share: float, headroom: float, a: float,
                                     b: float) -> None:
    rho_op = min(1 / (1 + headroom), blind.RHO_OPERATING_MAX)
    curve = LatencyCurve.calibrate(sla, sla * share, rho_op)
    lo, hi = sorted((a, b))
    assert 0 < curve.p99_ms(lo) <= curve.p99_ms(hi)
    assert math.isfinite(curve.p99_ms(hi))


def test_world_is_deterministic_per_seed_and_silent_when_idle(steady) -> None:
    one, same, other = LatencyWorld(steady, seed=1), LatencyWorld(steady, seed=1), LatencyWorld(steady, seed=2)
    a, b, c = (w.observe("llama-70b", "vllm", 10) for w in (one, same, other))
    assert a is not None and b is not None and c is not None
    assert a == b and a.load.ttft_p99_s != c.load.ttft_p99_s
    assert a.load.rps_per_replica == c.load.rps_per_replica  # load is exact, p99 is noisy
    assert a.replicas >= 1 and a.load.rps_per_replica <= 10.0 / 1.2 + 1e-9
    idle = dataclasses.replace(steady, series={"llama-70b": dataclasses.replace(
        steady.series["llama-70b"], rps=(0.0,) * steady.n_steps)})
    assert LatencyWorld(idle).observe("llama-70b", "vllm", 3) is None


def test_readings_are_the_latency_model_taken_step_by_step() -> None:
    """Every step's reading (made for all steps at once) is the documented model computed
    for that step alone: the sizing of `costmodel.replicas`, `LatencyCurve.p99_ms` of the
    load at the SLA capacity and the step's noise, to the last bit; idle steps give none."""
    import zlib

    import numpy as np

    from gearshift.policies.costmodel import replicas

    trace = read_trace(TRACES / "fleet-mixed.jsonl.gz")
    world = LatencyWorld(trace, seed=3)
    start = trace.start.timestamp()
    checked = 0
    for m, p in trace.profiles.items():
        for e in trace.engines:
            rng = np.random.default_rng([3, zlib.crc32(f"{m}/{e}".encode())])
            noise = np.exp(blind.NOISE_SIGMA * rng.standard_normal(trace.n_steps)).tolist()
            curve, cap = world.curves[m, e], p.capacity_rps[e]
            for k, r in enumerate(trace.series[m].rps):
                n = replicas(r, cap, trace.headroom, p.min_replicas) if r > 0 else 0
                want = None if n <= 0 else (
                    start + k * trace.step_s, r / n,
                    curve.p99_ms(r / (n * cap)) * noise[k] / 1000.0, n)
                got = world.reading(m, e, k)
                assert got == want and (got is None or type(got[3]) is int), (m, e, k)
                checked += want is not None
    assert checked > 1000


def test_blind_view_hides_capacities_and_latencies(steady) -> None:
    view = blind_view(steady)
    p = view.profiles["llama-70b"]
    assert all(math.isnan(p.capacity_rps[e]) and math.isnan(p.ttft_p99_ms[e]) for e in steady.engines)
    assert p.build_s == steady.profiles["llama-70b"].build_s  # not a capacity: still known


def test_policy_path_never_reads_header_capacities(default, steady) -> None:
    """Whatever the policy's view says about capacity (NaN or nonsense), nothing changes."""
    nonsense = dataclasses.replace(steady, profiles={m: dataclasses.replace(
        p, capacity_rps=dict.fromkeys(steady.engines, 1e9),
        ttft_p99_ms=dict.fromkeys(steady.engines, 1.0))
        for m, p in steady.profiles.items()})
    hidden_out, hidden_dec = simulate(default, steady, blind=True)
    odd_out, odd_dec = simulate(default, steady, blind=True, policy_view=nonsense)
    assert hidden_out == odd_out
    assert [d.to_dict() for d in hidden_dec["llama-70b"]] == [d.to_dict() for d in odd_dec["llama-70b"]]
    assert hidden_dec["llama-70b"], "the policy should still learn and move"


def test_decisions_cite_learned_capacity_priors_and_the_forecast(default, steady) -> None:
    _, decisions = simulate(default, steady, blind=True)
    first = decisions["llama-70b"][0]
    assert first.to_engine == "tensorrt-llm"
    i = first.inputs
    assert i["capacity_source.vllm"] in ("measured", "lower_bound")
    assert i["capacity_source.tensorrt-llm"] == "default-ratio"
    assert "default ratio" in str(i["capacity_note.tensorrt-llm"])
    assert "too little data on tensorrt-llm" in str(i["capacity_note.tensorrt-llm"])
    assert i["capacity_ratio.tensorrt-llm"] == pytest.approx(1.05)
    assert i["capacity_ratio_low.tensorrt-llm"] < 1.05 < i["capacity_ratio_high.tensorrt-llm"]
    assert i["capacity_rps.tensorrt-llm"] == pytest.approx(1.05 * i["capacity_rps.vllm"])
    assert isinstance(i["capacity_rps.vllm"], float) and i["capacity_low.vllm"] is not None
    assert i["capacity_rps.vllm"] < 10.0  # learned, not the header's 10 rps
    assert i["forecast_status"] == "ok" and i["forecast_method"] in ("recent-quantile", "seasonal-gbm")
    assert isinstance(i["forecast_sustained_rps"], float) and i["forecast_horizon_h"] == 168.0
    # The forecast made the decision: it set the traffic level of the savings estimate.
    assert i["traffic_basis"] == "forecast"
    assert i["traffic_level_rps"] == i["forecast_sustained_rps"]
    assert i["traffic_scale"] == pytest.approx(i["forecast_sustained_rps"] / i["rps_sustained"])
    json.dumps(first.to_dict())


def test_policy_priors_steer_the_unmeasured_engine(steady) -> None:
    """Priors of both engines give the ratio to the measured one (here: TensorRT-LLM slower,
    so no move); a lone absolute prior is used as is."""
    slower = load_policy(policy_text(
        "  models:\n    'llama-*':\n      engines:\n        vllm: {capacityRps: 10}\n"
        "        tensorrt-llm: {capacityRps: 9}\n"))
    _, decisions = simulate(slower, steady, blind=True)
    assert decisions["llama-70b"] == []
    faster = load_policy(policy_text(
        "  models:\n    'llama-*':\n      engines:\n        tensorrt-llm: {capacityRps: 12}\n"))
    _, moved = simulate(faster, steady, blind=True)
    assert moved["llama-70b"][0].inputs["capacity_source.tensorrt-llm"] == "prior"
    assert moved["llama-70b"][0].inputs["capacity_rps.tensorrt-llm"] == 12
    assert str(moved["llama-70b"][0].inputs["capacity_note.tensorrt-llm"]).startswith(
        "policy prior (spec.models); too little data on tensorrt-llm")


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_blind", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_blind_default_policy_meets_the_target_on_single_model_traces() -> None:
    """Within 3% of the oracle, no more flaps (fleet-mixed, ~25 s, is left to the bench)."""
    result = _bench().evaluate(TRACES, SINGLE_MODEL_TRACES)
    for name, t in result["traces"].items():
        assert t["blind"]["excess_vs_oracle"] <= 0.03, (name, t)
        assert t["blind"]["flaps"] <= t["oracle_flaps"], (name, t)
        assert t["blind"]["sla_violation_min"] <= t["oracle_sla_violation_min"], (name, t)
    assert result["all_meet_target"]


def test_cli_blind_prints_the_design_json() -> None:
    args = ["backtest", str(EXAMPLES / "default.yaml"), "--trace",
            str(TRACES / "steady-70b.jsonl.gz"), "--blind"]
    out = CliRunner().invoke(policy_cli, [*args, "-o", "json"])
    assert out.exit_code == 0, out.output
    r = json.loads(out.output)
    assert list(r) == ["policy", "trace", "models", "summary", "baselines"]
    assert r["models"]["llama-70b"]["switches"][0]["to"] == "tensorrt-llm"
    text = CliRunner().invoke(policy_cli, args)
    assert text.exit_code == 0 and "blind run" in text.output


def test_non_blind_runs_are_unchanged(default, steady) -> None:
    r = run_backtest(default, steady)
    assert r["summary"]["cost_usd"] == 172810.27  # the header-fact figure of bench/backtest.py
