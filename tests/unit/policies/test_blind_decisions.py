"""Blind backtest decisions pinned on a small generated fleet: the learned capacity is
kept up to date incrementally, and the switches, the figures each decision cites and
the summary must be those of a fit from scratch at every step (figures recorded from
that implementation)."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from gearshift.policies import backtest
from gearshift.policies.backtest import run_backtest, simulate
from gearshift.policies.loader import load_policy_file
from gearshift.policies.trace import Trace, parse_trace

from .conftest import EXAMPLES_DIR, profile, trace_lines

STEP_S = 300
# name: (GPUs per replica, vLLM and TensorRT-LLM capacity (req/s per replica), mean rate (req/s))
FLEET = {"big-70b": (8, 10.0, 11.6, 60.0), "mid-13b": (2, 18.0, 21.6, 90.0),
         "small-8b": (1, 40.0, 38.0, 150.0)}


def fleet_trace(days: int = 10, seed: int = 7) -> Trace:
    """A diurnal fleet with rare bursts and two revisions per model (the small model is
    slower on TensorRT-LLM, so the policy tries it and comes back)."""
    rng = random.Random(seed)
    n = days * 86400 // STEP_S
    profiles, rates, revisions = {}, {}, {}
    for m, (gpus, vllm, trt, level) in FLEET.items():
        profiles[m] = profile(gpus_per_replica=gpus, capacity_rps={"vllm": vllm, "tensorrt-llm": trt})
        rates[m] = [round(max(0.0, level * (1 + 0.4 * math.sin(2 * math.pi * (k * STEP_S % 86400) / 86400))
                              * rng.uniform(0.9, 1.1) * (rng.uniform(2, 4) if rng.random() < 0.003 else 1)), 3)
                    for k in range(n)]
        revisions[m] = sorted(rng.sample(range(n), 2))
    return parse_trace(trace_lines(rates, revisions=revisions, profiles=profiles), source="generated")


@pytest.fixture(scope="module")
def default() -> Any:
    return load_policy_file(str(EXAMPLES_DIR / "default.yaml"))


@pytest.fixture(scope="module")
def trace() -> Trace:
    return fleet_trace()


def test_switches_and_summary_are_pinned(default, trace) -> None:
    r = run_backtest(default, trace, blind=True)
    switches = {m: [(s["ts"], s["to"], s["rule"]) for s in v["switches"]]
                for m, v in r["models"].items()}
    assert switches == {
        "big-70b": [("2026-03-02T06:00:00Z", "tensorrt-llm", "cost")],
        "mid-13b": [("2026-03-02T06:00:00Z", "tensorrt-llm", "cost")],
        "small-8b": [("2026-03-02T06:45:00Z", "tensorrt-llm", "cost"),
                     ("2026-03-03T07:30:00Z", "vllm", "cost")],
    }
    assert r["summary"] == {"cost_usd": 68812.3, "flaps": 0, "revision_lag_h": 2.51,
                            "sla_violation_min": 0.0}


def test_learned_capacities_cited_by_decisions_are_pinned(default, trace) -> None:
    _, decisions = simulate(default, trace, blind=True)
    back = decisions["small-8b"][1].inputs  # the move back, on both engines' measurements
    assert back["capacity_source.vllm"] == "lower_bound"
    assert back["capacity_source.tensorrt-llm"] == "lower_bound"
    assert back["capacity_rps.vllm"] == pytest.approx(33.302)
    assert back["capacity_rps.tensorrt-llm"] == pytest.approx(31.576666666666668)
    assert back["capacity_low.tensorrt-llm"] == pytest.approx(31.498666666666665)  # bootstrap band
    assert back["capacity_high.tensorrt-llm"] == pytest.approx(31.576666666666668)
    assert back["forecast_sustained_rps"] == pytest.approx(93.1013)
    first = decisions["big-70b"][0].inputs
    assert first["capacity_rps.vllm"] == pytest.approx(8.3209)
    assert first["capacity_source.tensorrt-llm"] == "default-ratio"
    assert first["capacity_low.tensorrt-llm"] == pytest.approx(7.821646)
    assert first["capacity_high.tensorrt-llm"] == pytest.approx(9.652244)
    assert first["forecast_sustained_rps"] == pytest.approx(62.1971)


def test_fleet_pass_of_the_savings_counts_changes_no_decision(default, trace, monkeypatch) -> None:
    """The replica counts of the savings estimates worked out for the fleet at once at each
    step (`economics.prepare_estimates`) give every decision, with every figure it cites
    and expects, and every outcome, of the counts each model works out alone."""
    outcomes, decisions = simulate(default, trace, blind=True)
    monkeypatch.setattr(backtest, "prepare_estimates", lambda signals: None)
    alone_outcomes, alone = simulate(default, trace, blind=True)
    assert outcomes == alone_outcomes
    assert {m: [d.to_dict() for d in ds] for m, ds in decisions.items()} == \
        {m: [d.to_dict() for d in ds] for m, ds in alone.items()}
    assert sum(len(ds) for ds in decisions.values()) > 0
