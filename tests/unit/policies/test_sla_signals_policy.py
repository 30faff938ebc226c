"""SLA signals in policies: a measured breach acts at once (before minHistory; the
backtest's SLA minutes equal the target's start-up time), queue time warns of saturation
before TTFT breaks, and the new signals are usable, with units, in rules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from gearshift.cli.policy_cmds import policy as policy_cli
from gearshift.policies.backtest import run_backtest
from gearshift.policies.core import ModelState, decide
from gearshift.policies.costmodel import replay_model
from gearshift.policies.loader import PolicyError, load_policy, load_policy_file
from gearshift.policies.signals import (
    LATENCY_SOURCE,
    PRIOR_SOURCE,
    EngineFacts,
    ModelFacts,
    ModelHistory,
    compute_signals,
)

EXAMPLES = Path(__file__).parents[3] / "policies" / "examples"
STEP_S = 300.0
T0 = 1_772_409_600.0  # 2026-03-02T00:00:00Z
DAY_S = 86400.0


def default():  # type: ignore[no-untyped-def]
    return load_policy_file(str(EXAMPLES / "default.yaml"))


def facts(vllm: dict[str, Any] | None = None, **overrides: Any) -> ModelFacts:
    current: dict[str, Any] = {"capacity_rps": 10.0, "ttft_p99_ms": 900.0, "cold_start_s": 210,
                               "build_s": 0, "build_overhead_usd": 0.0, **(vllm or {})}
    engines = {
        "vllm": EngineFacts(**current),
        "tensorrt-llm": EngineFacts(capacity_rps=11.6, ttft_p99_ms=780.0, cold_start_s=240,
                                    build_s=1800, build_overhead_usd=150.0),
    }
    kw: dict[str, Any] = {"gpus_per_replica": 8, "sla_ttft_p99_ms": 1000.0, "engines": engines,
                          "nvidia": True, "price_per_gpu_hour": 4.0}
    kw.update(overrides)
    return ModelFacts(**kw)


def decide_one(policy, rates: list[float], f: ModelFacts, now: float,  # type: ignore[no-untyped-def]
               since: float = T0 - 30 * DAY_S):
    ts = T0 + np.arange(len(rates)) * STEP_S
    hist = ModelHistory.of(ts, rates, [], STEP_S)
    sig = compute_signals("m", hist, f, now, policy.signal_settings)
    return decide(policy, {"m": sig}, {"m": ModelState(engine="vllm", since=since)}, now)


# --- a measured breach acts at once -----------------------------------------------------

def sla_bound_trace(tmp_path: Path, lines_of, profile_of, steps: int = 48) -> Path:  # type: ignore[no-untyped-def]
    slow = profile_of(ttft_p99_ms={"vllm": 1300.0, "tensorrt-llm": 780.0})
    path = tmp_path / "sla-bound.jsonl"
    path.write_text("\n".join(lines_of({"m": [8.0] * steps}, profiles={"m": slow})) + "\n")
    return path


def test_a_measured_breach_costs_only_the_targets_start_up_time(tmp_path, lines_of,
                                                                profile_of) -> None:
    """An SLA-bound trace (vLLM breaks the TTFT target from the first minute) through
    `gearshift policy backtest`: the switch is decided at the first step, before minHistory,
    and the SLA minutes are the physical minimum: TensorRT-LLM's build + cold start."""
    trace = sla_bound_trace(tmp_path, lines_of, profile_of)
    out = CliRunner().invoke(policy_cli, ["backtest", str(EXAMPLES / "default.yaml"),
                                          "--trace", str(trace), "-o", "json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.output)
    model = result["models"]["m"]
    assert model["switches"] == [{"ts": "2026-03-02T00:00:00Z", "to": "tensorrt-llm",
                                  "rule": "sla-first"}]
    delay_steps = -(-(1800 + 240) // 300)  # the cost model's delay(tensorrt-llm)
    assert model["sla_violation_min"] == delay_steps * 5 == 35
    assert result["summary"]["sla_violation_min"] == 35
    # The contract's layout is unchanged.
    assert list(result) == ["policy", "trace", "models", "summary", "baselines"]
    # Without the early guard the same switch after minHistory (1 h = 12 steps) costs 60 min more.
    from gearshift.policies.trace import read_trace
    later = replay_model(read_trace(trace), "m", {12: "tensorrt-llm"})
    assert later.sla_violation_min == 35 + 60


def test_before_min_history_only_a_measured_breach_moves(tmp_path) -> None:
    policy = default()
    now = T0 + 600  # 10 min of history, under minHistory (1 h)
    rates = [150.0] * 2
    # A cost move (it would pay later) waits for history.
    assert decide_one(policy, rates, facts(), now) == []
    # A breach measured now moves at once, urgent.
    [d] = decide_one(policy, rates, facts(vllm={"ttft_p99_ms": 1300.0}), now)
    assert (d.to_engine, d.rule, d.urgent) == ("tensorrt-llm", "sla-first", True)
    # A "breach" that is only the policy's prior waits for a measurement.
    prior = facts(vllm={"ttft_p99_ms": 1300.0},
                  citations={f"{LATENCY_SOURCE}.vllm": PRIOR_SOURCE})
    assert decide_one(policy, rates, prior, now) == []


# --- queue time: saturation seen before TTFT breaks -------------------------------------

def test_queue_share_of_the_ttft_budget_warns_before_ttft_breaks() -> None:
    policy = default()
    now = T0 + DAY_S
    rates = [20.0] * 300  # little traffic: no cost move either way
    calm = facts(vllm={"queue_p99_ms": 100.0})
    assert decide_one(policy, rates, calm, now) == []
    # TTFT still meets its 1000 ms target (900 ms) but 600 ms of it is queueing.
    [d] = decide_one(policy, rates, facts(vllm={"queue_p99_ms": 600.0}), now)
    assert (d.to_engine, d.rule, d.urgent) == ("tensorrt-llm", "sla-first", False)
    [test] = d.conditions
    assert (test.signal, test.operator, test.threshold, test.observed, test.unit) == (
        "queue_share_of_ttft_sla", "ge", 0.5, 0.6, "ratio")
    assert d.inputs["queue_p99_ms"] == 600.0 and "saturation coming" in d.reason
    # Not urgent: it waits out the minimum dwell, unlike a measured breach.
    assert decide_one(policy, rates, facts(vllm={"queue_p99_ms": 600.0}), now,
                      since=now - 3600) == []
    # No engine with more capacity per replica: no move, and it says why.
    weaker = facts(vllm={"queue_p99_ms": 600.0, "capacity_rps": 12.0})
    assert decide_one(policy, rates, weaker, now) == []


def test_the_warning_threshold_is_a_rule_parameter(policy_yaml) -> None:
    rules = ("    - {name: sla, kind: sla-guard, params: {queueShareOfTtftSla: 0.8}}\n"
             "    - {name: cost, kind: expected-savings}\n")
    strict = load_policy(policy_yaml(rules=rules), "p.yaml")
    assert decide_one(strict, [20.0] * 300, facts(vllm={"queue_p99_ms": 600.0}),
                      T0 + DAY_S) == []
    off = load_policy(policy_yaml(rules=rules.replace("0.8", "null")), "p.yaml")
    assert decide_one(off, [20.0] * 300, facts(vllm={"queue_p99_ms": 990.0}), T0 + DAY_S) == []
    with pytest.raises(PolicyError, match="queueShareOfTtftSla"):
        load_policy(policy_yaml(rules=rules.replace("0.8", "1.5")), "p.yaml")


# --- the signals in rules -----------------------------------------------------------------

THRESHOLD = """    - name: cache-friendly
      kind: threshold
      prefer: tensorrt-llm
      when:
        - {signal: prefix_cache_hit_rate, gt: 0.5}
        - {signal: preemptions_per_s, ge: 1}
        - {signal: mean_prompt_tokens, gt: 2000}
"""


def test_threshold_rules_read_the_new_signals_with_units(policy_yaml) -> None:
    policy = load_policy(policy_yaml(rules=THRESHOLD), "p.yaml")
    f = facts(vllm={"prefix_cache_hit_rate": 0.7, "preemptions_per_s": 2.0,
                    "mean_prompt_tokens": 4000.0})
    [d] = decide_one(policy, [20.0] * 300, f, T0 + DAY_S)
    assert d.rule == "cache-friendly"
    units = {c.signal: (c.observed, c.unit) for c in d.conditions}
    assert units == {"prefix_cache_hit_rate": (0.7, "ratio"), "preemptions_per_s": (2.0, "req/s"),
                     "mean_prompt_tokens": (4000.0, "tokens")}
    # Unknown (an engine that does not export the signal) never fires a rule.
    assert decide_one(policy, [20.0] * 300, facts(), T0 + DAY_S) == []


def test_validate_knows_the_signals_and_suggests_names(policy_yaml) -> None:
    with pytest.raises(PolicyError) as err:
        load_policy(policy_yaml(rules=THRESHOLD.replace("prefix_cache_hit_rate",
                                                        "prefix_cache_hitrate")), "p.yaml")
    assert "did you mean 'prefix_cache_hit_rate'" in str(err.value)
    never = load_policy(policy_yaml(rules=THRESHOLD.replace("gt: 0.5", "gt: 1.5")), "p.yaml")
    assert any("prefix_cache_hit_rate" in w and "never" in w for w in never.warnings)


def test_backtests_of_the_shipped_traces_never_read_queue_time(tmp_path, lines_of,
                                                              profile_of) -> None:
    """Traces carry no queue time: the warning cannot change a replayed decision."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines_of({"m": [8.0] * 24})) + "\n")
    from gearshift.policies.trace import read_trace
    result = run_backtest(default(), read_trace(trace))
    assert result["models"]["m"]["switches"] == []
