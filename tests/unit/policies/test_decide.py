"""The pure decision core: decisions as data, SLA first, guardrails, and no peeking
at data from `now` on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gearshift.policies.core import Decision, ModelState, cost_settings, decide
from gearshift.policies.fleet_estimates import estimate_fleet_moves
from gearshift.policies.forecast import Forecast, decision_forecast
from gearshift.policies.loader import load_policy, load_policy_file
from gearshift.policies.signals import (
    EngineFacts,
    ModelFacts,
    ModelHistory,
    SignalSettings,
    compute_signals,
)

EXAMPLES = Path(__file__).parents[3] / "policies" / "examples"
STEP_S = 300.0
T0 = 1_772_409_600.0  # 2026-03-02T00:00:00Z
DAY_S = 86400.0


def facts(**overrides: Any) -> ModelFacts:
    engines = {
        "vllm": EngineFacts(capacity_rps=10.0, ttft_p99_ms=900.0, cold_start_s=210, build_s=0,
                            build_overhead_usd=0.0),
        "tensorrt-llm": EngineFacts(capacity_rps=11.6, ttft_p99_ms=780.0, cold_start_s=240,
                                    build_s=1800, build_overhead_usd=150.0),
    }
    kw: dict[str, Any] = {"gpus_per_replica": 8, "sla_ttft_p99_ms": 1000.0, "engines": engines,
                          "nvidia": True, "price_per_gpu_hour": 4.0}
    kw.update(overrides)
    return ModelFacts(**kw)


def history(rates: list[float], revisions: list[float] | None = None) -> ModelHistory:
    ts = T0 + np.arange(len(rates)) * STEP_S
    return ModelHistory.of(ts, rates, revisions or [], STEP_S)


def run(policy, models: dict[str, tuple[list[float], ModelFacts]], now: float,
        states: dict[str, ModelState] | None = None) -> list[Decision]:
    settings = policy.signal_settings
    signals = {m: compute_signals(m, history(r), f, now, settings) for m, (r, f) in models.items()}
    states = states or {m: ModelState(engine="vllm", since=T0 - 30 * DAY_S) for m in models}
    decisions = decide(policy, signals, states, now)
    # The live tick's way: every model's estimates made at once and handed to the core.
    estimates = estimate_fleet_moves(signals, {m: st.engine for m, st in states.items()},
                                     cost_settings(policy))
    assert repr([d.to_dict() for d in decide(policy, signals, states, now,
                                             estimates=estimates)]) == repr(
        [d.to_dict() for d in decisions])
    return decisions


def default():
    return load_policy_file(str(EXAMPLES / "default.yaml"))


def test_busy_model_moves_to_the_engine_with_more_measured_capacity() -> None:
    now = T0 + DAY_S
    [d] = run(default(), {"m": ([150.0] * 400, facts())}, now)
    assert (d.model, d.from_engine, d.to_engine, d.rule) == ("m", "vllm", "tensorrt-llm", "cost")
    assert d.policy_version == default().version and d.created_at == now
    assert d.expected["cost_usd_per_day"] < 0  # saves money
    assert d.expected["ttft_p99_ms"] == -120.0
    assert d.inputs["capacity_rps.tensorrt-llm"] == 11.6 and d.inputs["rps_mean"] == 150.0
    assert d.inputs["net_savings_usd"] > d.inputs["margin_usd"]
    assert any(opt == "vllm" and "stay" in why for opt, why in d.alternatives)
    json.dumps(d.to_dict())  # plain data


def test_no_move_when_measured_capacity_shows_no_gain() -> None:
    same = facts(engines={**facts().engines, "tensorrt-llm": EngineFacts(
        capacity_rps=9.5, ttft_p99_ms=780.0, cold_start_s=240, build_s=1800, build_overhead_usd=150.0)})
    assert run(default(), {"m": ([150.0] * 400, same)}, T0 + DAY_S) == []


def test_decisions_ignore_data_from_now_on() -> None:
    policy, now = default(), T0 + 2 * DAY_S
    base = [150.0] * 2000
    changed = base[:576] + [0.0] * (2000 - 576)  # everything from `now` on is different
    settings = policy.signal_settings
    s1 = compute_signals("m", history(base, [T0 + 3 * DAY_S]), facts(), now, settings)
    s2 = compute_signals("m", history(changed), facts(), now, settings)
    assert (s1.rps_mean, s1.rps_peak, s1.rps_sustained, s1.revisions_per_week) == (
        s2.rps_mean, s2.rps_peak, s2.rps_sustained, s2.revisions_per_week)
    state = {"m": ModelState(engine="vllm", since=T0 - 30 * DAY_S)}
    d1 = [d.to_dict() for d in decide(policy, {"m": s1}, state, now)]
    d2 = [d.to_dict() for d in decide(policy, {"m": s2}, state, now)]
    assert d1 == d2 and d1


def test_sla_breach_moves_at_once_even_within_dwell_and_never_onto_a_breaking_engine() -> None:
    slow_vllm = facts(engines={**facts().engines, "vllm": EngineFacts(
        capacity_rps=10.0, ttft_p99_ms=1500.0, cold_start_s=210, build_s=0, build_overhead_usd=0.0)})
    now = T0 + DAY_S
    just_moved = {"m": ModelState(engine="vllm", since=now - 600)}
    [d] = run(default(), {"m": ([3.0] * 400, slow_vllm)}, now, just_moved)
    assert (d.to_engine, d.rule, d.urgent) == ("tensorrt-llm", "sla-first", True)
    [c] = d.conditions  # what the guard tested, as data
    assert (c.signal, c.operator, c.threshold, c.observed, c.unit, c.held) == (
        "ttft_p99_ms", "gt", 1000.0, 1500.0, "ms", True)
    assert d.to_dict()["conditions"][0]["rule"] == "sla-first"
    slow_trt = facts(engines={**facts().engines, "tensorrt-llm": EngineFacts(
        capacity_rps=20.0, ttft_p99_ms=1500.0, cold_start_s=240, build_s=1800, build_overhead_usd=150.0)})
    assert run(default(), {"m": ([150.0] * 400, slow_trt)}, now) == []


def test_short_spike_does_not_trigger_a_move() -> None:
    rates = [3.0] * 2016 + [120.0] * 12 + [3.0] * 12  # a week quiet, one hour busy
    for hours_after in (1, 2):
        assert run(default(), {"m": (rates, facts())}, T0 + (2016 + 12 * hours_after) * STEP_S) == []


def test_guardrails_dwell_freeze_pin_migration_and_hardware(policy_yaml) -> None:
    busy = ([150.0] * 400, facts())
    now = T0 + DAY_S
    fresh = {"m": ModelState(engine="vllm", since=now - 3600)}
    assert run(default(), {"m": busy}, now, fresh) == []  # minimum dwell 24 h
    moving = {"m": ModelState(engine="vllm", since=T0 - DAY_S, migrating_to="tensorrt-llm")}
    assert run(default(), {"m": busy}, now, moving) == []
    frozen = {"m": ModelState(engine="vllm", since=T0 - DAY_S, frozen=True)}
    assert run(default(), {"m": busy}, now, frozen) == []
    assert run(default(), {"m": ([150.0] * 400, facts(nvidia=False))}, now) == []
    pinned = load_policy(policy_yaml("  guardrails:\n    pins: {'m*': vllm}\n    freezes: [x]\n"))
    assert run(pinned, {"m": busy, "x": busy}, now) == []
    on_trt = {"m": ModelState(engine="tensorrt-llm", since=now - 60)}
    [d] = run(pinned, {"m": busy}, now, on_trt)
    assert (d.to_engine, d.rule) == ("vllm", "pin")


def test_concurrency_budget_keeps_the_biggest_savings(policy_yaml) -> None:
    policy = load_policy(policy_yaml("  guardrails: {maxConcurrentMigrations: 2}\n"))
    models = {"small": ([40.0] * 400, facts()), "big": ([300.0] * 400, facts()),
              "mid": ([150.0] * 400, facts()), "busy": ([150.0] * 400, facts())}
    states = {m: ModelState(engine="vllm", since=T0 - 30 * DAY_S) for m in models}
    states["busy"] = ModelState(engine="vllm", since=T0 - 30 * DAY_S, migrating_to="tensorrt-llm")
    [d] = run(policy, models, T0 + DAY_S, states)
    assert d.model == "big"


def test_maintenance_windows_gate_cost_moves(policy_yaml) -> None:
    policy = load_policy(policy_yaml("  guardrails:\n    maintenanceWindows:\n"
                                     "      - {cron: '0 2 * * *', duration: 1h}\n"))
    busy = {"m": ([150.0] * 600, facts())}
    assert run(policy, busy, T0 + DAY_S + 3600) == []
    assert len(run(policy, busy, T0 + DAY_S + 2.5 * 3600)) == 1


def test_selector_and_threshold_rules(policy_yaml) -> None:
    rules = ("    - name: heavy\n      kind: threshold\n      prefer: tensorrt-llm\n"
             "      when:\n        - {signal: rps_sustained, gt: 100}\n        - {signal: nvidia, eq: true}\n")
    policy = load_policy(policy_yaml("  selector: {globs: ['llama-*'], labels: {tier: prod}}\n",
                                     rules=rules))
    prod = facts(labels={"tier": "prod"})
    got = run(policy, {"llama-1": ([150.0] * 400, prod), "llama-2": ([150.0] * 400, facts()),
                       "qwen": ([150.0] * 400, prod), "llama-3": ([50.0] * 400, prod)}, T0 + DAY_S)
    assert [(d.model, d.rule) for d in got] == [("llama-1", "heavy")]
    assert got[0].inputs["rps_sustained"] == 150.0
    assert [(c.signal, c.operator, c.threshold, c.observed, c.held, c.group)
            for c in got[0].conditions] == [("rps_sustained", "gt", 100, 150.0, True, "when"),
                                            ("nvidia", "eq", True, True, True, "when")]
    assert got[0].reason.startswith("met: ")


def test_rolling_cache_matches_direct_computation() -> None:
    rng = np.random.default_rng(7)
    rates = list(rng.gamma(2.0, 20.0, size=3000))
    ts = T0 + np.arange(len(rates)) * STEP_S
    plain = ModelHistory.of(ts, rates, [], STEP_S)
    cached = ModelHistory.of(ts, rates, [], STEP_S, replay=True)
    settings = SignalSettings()
    for k in (1, 100, 288, 289, 2500, 3000):
        a = compute_signals("m", plain, facts(), T0 + k * STEP_S, settings)
        b = compute_signals("m", cached, facts(), T0 + k * STEP_S, settings)
        assert (a.rps_peak, a.rps_sustained, a.rps_mean) == (b.rps_peak, b.rps_sustained, b.rps_mean)


# ---- the traffic forecast sets the level of the savings estimate ---------------------


def forecast(sustained: float | None, now: float, status: str = "ok") -> Forecast:
    """A forecast made at `now` whose sustained level over the horizon is `sustained`."""
    if status != "ok":
        return Forecast("insufficient_data", "none", None, None, 7 * DAY_S, 0.1,
                        "insufficient data: 3 valid rate sample(s) before now, need 12", 3)
    assert sustained is not None
    return Forecast("ok", "seasonal-gbm", sustained, sustained * 1.5, 7 * DAY_S, 0.1, "", 2000,
                    start_ts=now)


def signals_with(policy, rates: list[float], now: float, fc: Forecast | None):  # type: ignore[no-untyped-def]
    return {"m": compute_signals("m", history(rates), facts(), now, policy.signal_settings, fc)}


def test_a_forecast_moves_the_savings_estimate_in_its_direction() -> None:
    """A quieter last day after a busy week: the forecast sets the short window's level."""
    policy = default()
    rates = [250.0] * (6 * 288) + [150.0] * 288
    now = T0 + 7 * DAY_S
    state = {"m": ModelState(engine="vllm", since=T0 - 30 * DAY_S)}
    got = {}
    for name, fc in (("observed", None), ("falling", forecast(75.0, now)),
                     ("rising", forecast(200.0, now))):
        [d] = decide(policy, signals_with(policy, rates, now, fc), state, now)
        got[name] = d.inputs
    observed, falling, rising = got["observed"], got["falling"], got["rising"]
    assert observed["traffic_basis"] == "observed" and observed["traffic_scale"] == 1.0
    assert observed["traffic_level_rps"] == observed["rps_sustained"] == 150.0
    assert falling["traffic_basis"] == rising["traffic_basis"] == "forecast"
    assert (falling["traffic_level_rps"], rising["traffic_level_rps"]) == (75.0, 200.0)
    assert falling["savings_usd_per_h"] < observed["savings_usd_per_h"] < rising["savings_usd_per_h"]
    assert falling["net_savings_usd"] < observed["net_savings_usd"] < rising["net_savings_usd"]
    assert rising["savings_usd_per_h"] <= rising["savings_long_usd_per_h"]  # the long window caps it
    assert rising["forecast_sustained_rps"] == 200.0 and rising["forecast_peak_rps"] == 300.0


def test_traffic_expected_to_fall_holds_a_move_back() -> None:
    policy, now = default(), T0 + DAY_S
    state = {"m": ModelState(engine="vllm", since=T0 - 30 * DAY_S)}
    rates = [150.0] * 400
    assert decide(policy, signals_with(policy, rates, now, forecast(150.0, now)), state, now)
    assert decide(policy, signals_with(policy, rates, now, forecast(5.0, now)), state, now) == []


def test_without_a_usable_forecast_the_observed_level_is_used_and_the_decision_says_why() -> None:
    policy, now = default(), T0 + DAY_S
    state = {"m": ModelState(engine="vllm", since=T0 - 30 * DAY_S)}
    rates = [150.0] * 400
    [plain] = decide(policy, signals_with(policy, rates, now, None), state, now)
    [d] = decide(policy, signals_with(policy, rates, now, forecast(None, now, "insufficient")),
                 state, now)
    assert d.inputs["traffic_basis"] == "observed" and d.inputs["forecast_status"] == "insufficient_data"
    assert "insufficient data" in str(d.inputs["traffic_note"])
    assert d.expected == plain.expected


def test_a_forecast_made_after_now_is_refused() -> None:
    now = T0 + DAY_S
    with pytest.raises(ValueError, match="after now"):
        compute_signals("m", history([150.0] * 400), facts(), now, SignalSettings(),
                        forecast(150.0, now + 300))


def test_forecast_driven_decisions_ignore_data_from_now_on() -> None:
    """The adapters' forecast reads samples before now only: what follows changes nothing."""
    policy, now = default(), T0 + 9 * DAY_S
    rng = np.random.default_rng(3)
    day = 150.0 + 60.0 * np.sin(2 * np.pi * np.arange(288) / 288)
    base = list(np.tile(day, 12) * rng.uniform(0.9, 1.1, 12 * 288))
    end = int(9 * DAY_S / STEP_S)
    changed = base[:end] + [0.0] * (len(base) - end)
    state = {"m": ModelState(engine="vllm", since=T0 - 30 * DAY_S)}
    out = []
    for rates in (base, changed):
        h = history(rates)
        fc = decision_forecast(h.sample_ts, h.rps, now, policy.doc.spec.cost.horizon, step_s=STEP_S,
                               quantile=policy.doc.spec.signals.sustained_quantile)
        assert fc.status == "ok" and fc.method == "seasonal-gbm"
        sig = compute_signals("m", h, facts(), now, policy.signal_settings, fc)
        out.append([d.to_dict() for d in decide(policy, {"m": sig}, state, now)])
    assert out[0] == out[1] and out[0]
    assert out[0][0]["inputs"]["traffic_basis"] == "forecast"
