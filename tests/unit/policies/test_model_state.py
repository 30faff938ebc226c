"""The model-state rules shared by the live loop and the backtest (`policies.model_state`),
and the backtest path through them: dwell from the tenure, cooldown from the switch
records, trials decided by the core with the move."""

from __future__ import annotations

import itertools
from pathlib import Path

from gearshift.policies.backtest import simulate
from gearshift.policies.loader import load_policy
from gearshift.policies.model_state import (
    SwitchOutcome,
    SwitchRecord,
    Tenure,
    advance_tenure,
    current_engine,
    last_switch,
    trial_share,
)
from gearshift.policies.schema import Trials
from gearshift.policies.trace import read_trace

TRACES = Path(__file__).parent / "traces"


def test_current_engine_keeps_the_source_of_a_move_and_breaks_ties_by_the_previous_one() -> None:
    assert current_engine({"vllm": 2, "sglang": 1}) == "vllm"
    assert current_engine({"vllm": 1, "tensorrt-llm": 3}, moving_from="vllm") == "vllm"
    assert current_engine({"vllm": 1, "tensorrt-llm": 1}, previous="tensorrt-llm") == "tensorrt-llm"
    assert current_engine({"vllm": 1, "tensorrt-llm": 1}, previous="sglang") == "tensorrt-llm"
    assert current_engine({"vllm": 0}) is None


def test_tenure_starts_at_first_sight_and_restarts_only_on_a_change() -> None:
    first = advance_tenure(None, "vllm", 1000.0, first_seen=400.0)
    assert first == Tenure("vllm", 400.0)
    assert advance_tenure(first, "vllm", 2000.0, first_seen=1500.0) is first
    assert advance_tenure(first, "sglang", 3000.0, first_seen=0.0) == Tenure("sglang", 3000.0)


def test_rollbacks_count_for_the_cooldown_and_trials_do_not() -> None:
    records = [SwitchRecord(100.0, SwitchOutcome.DONE), SwitchRecord(300.0, SwitchOutcome.TRIAL),
               SwitchRecord(200.0, SwitchOutcome.ROLLED_BACK)]
    assert last_switch(records) == 200.0
    assert last_switch([SwitchRecord(50.0, SwitchOutcome.IN_FLIGHT)]) == 50.0
    assert last_switch([SwitchRecord(50.0, SwitchOutcome.TRIAL)]) is None


def test_a_trial_is_needed_only_for_an_unmeasured_untried_target() -> None:
    on = Trials(enabled=True, share=0.2)
    assert trial_share(on, "sglang", "default-ratio", ()) == 0.2
    assert trial_share(on, "sglang", "measured", ()) is None
    assert trial_share(on, "sglang", "prior", {"sglang"}) is None
    assert trial_share(Trials(), "sglang", "prior", ()) is None


POLICY = """\
apiVersion: gearshift.dev/v1
kind: EnginePolicy
metadata: {{name: flip}}
spec:
  interval: 5m
  signals: {{window: 1h, longWindow: 2h, minHistory: 0s}}
  rules:
    - name: to-trt
      kind: threshold
      prefer: tensorrt-llm
      when: [{{signal: engine, eq: vllm}}]
    - name: to-vllm
      kind: threshold
      prefer: vllm
      when: [{{signal: engine, eq: tensorrt-llm}}]
  guardrails: {{minDwell: {dwell}, cooldown: {cooldown}, maxConcurrentMigrations: 5}}
{extra}"""


def _switch_gaps_h(dwell: str, cooldown: str, extra: str = "") -> tuple[list[float], list]:
    trace = read_trace(TRACES / "steady-70b.jsonl.gz")
    policy = load_policy(POLICY.format(dwell=dwell, cooldown=cooldown, extra=extra), "flip.yaml")
    _out, accepted = simulate(policy, trace)
    decisions = accepted["llama-70b"]
    times = [d.created_at for d in decisions]
    return [(b - a) / 3600 for a, b in itertools.pairwise(times)], decisions


def test_backtest_path_applies_dwell_and_cooldown_from_the_shared_state() -> None:
    # A policy that always wants the other engine: how often it may switch is exactly
    # what the model state allows (TensorRT-LLM needs 30 min to build and 4 min to start).
    free, _ = _switch_gaps_h("0s", "0s")
    dwell, _ = _switch_gaps_h("6h", "0s")
    cooldown, _ = _switch_gaps_h("0s", "12h")
    assert free and min(free) < 6
    assert dwell and min(dwell) >= 6  # time on the engine, restarted by each arrival
    assert cooldown and all(g >= 12 for g in cooldown)  # from the last decided switch


def test_backtest_path_decides_trials_in_the_core_and_remembers_them() -> None:
    extra = "  trials: {enabled: true, share: 0.2}\n"
    trace = read_trace(TRACES / "steady-70b.jsonl.gz")
    policy = load_policy(POLICY.format(dwell="0s", cooldown="0s", extra=extra), "flip.yaml")
    _out, accepted = simulate(policy, trace)  # the header is cited as measured: no trial
    assert accepted["llama-70b"] and all(
        d.trial_share is None for d in accepted["llama-70b"])
    # Blind, capacities are not measured at first: the first move to each engine is a
    # trial, decided by the core; afterwards the engine counts as trialled.
    _out, blind = simulate(policy, trace, blind=True)
    shares = [(d.to_engine, d.trial_share) for d in blind["llama-70b"]]
    firsts = {}
    for engine, share in shares:
        firsts.setdefault(engine, share)
    assert firsts.get("tensorrt-llm") == 0.2, shares
    later = [s for e, s in shares[2:] if e == "tensorrt-llm"]
    assert all(s is None for s in later), shares
