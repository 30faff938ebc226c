"""Every model's signals at once (`compute_fleet_signals`) are exactly those that
`compute_signals` gives each model from its own samples: gaps, windows, revisions."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gearshift.controller.ingest.rate_history import RateHistory
from gearshift.policies.costmodel import REPLICA_EPSILON, CostModelError, replicas
from gearshift.policies.fleet_signals import FleetModel, compute_fleet_signals
from gearshift.policies.signals import (
    EngineFacts,
    ModelFacts,
    ModelHistory,
    SignalSettings,
    compute_signals,
)

STEP_S = 60.0
T0 = 1_700_000_000.0
SETTINGS = SignalSettings(window_s=40 * STEP_S, long_window_s=200 * STEP_S,
                          revision_window_s=100 * STEP_S)
FACTS = ModelFacts(gpus_per_replica=1, engines={"vllm": EngineFacts(capacity_rps=4.0)})


def _fleet(seed: int, models: int, steps: int, gap_share: float) -> RateHistory:
    rng = np.random.default_rng(seed)
    history = RateHistory(STEP_S, retention_s=150 * STEP_S)
    for k in range(steps):
        rates = {f"m{i}": float(rng.lognormal(1.0, 1.0)) for i in range(models)
                 if rng.random() >= gap_share}
        history.sample(T0 + k * STEP_S, rates)
    return history


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), models=st.integers(1, 300), steps=st.integers(0, 260),
       gap_share=st.sampled_from([0.0, 0.0, 0.01, 0.3]), at=st.floats(-5.0, 270.0))
def test_the_same_signals_as_model_by_model(seed: int, models: int, steps: int,
                                            gap_share: float, at: float) -> None:
    history = _fleet(seed, models, steps, gap_share)
    now = T0 + at * STEP_S
    rng = np.random.default_rng(seed + 1)
    wanted = {f"m{i}": FleetModel(FACTS, sorted(float(T0 + t * STEP_S)
                                               for t in rng.uniform(-50, 260, rng.integers(0, 4))))
              for i in range(models + 2)}  # two never sampled
    fleet = compute_fleet_signals(history.axis(), history.blocks(), wanted, now, SETTINGS,
                                  STEP_S)
    assert set(fleet) == set(wanted)
    for model, fm in wanted.items():
        ts, rps = history.arrays(model)
        one = compute_signals(model, ModelHistory.of(ts, rps, fm.revision_ts, STEP_S), FACTS, now,
                              SETTINGS)
        mine = fleet[model]
        assert mine == one  # every figure, to the last bit
        assert (mine.rps_peak, mine.rps_sustained) == (one.rps_peak, one.rps_sustained)
        windows = ((one.window_samples, 1.0), (one.long_window_samples, 1.0),
                   (one.window_samples, 1.5), (one.long_window_samples, 1.5))
        assert (mine.replica_means((3.0, 0.7), 0.2, 1, windows)
                == one.replica_means((3.0, 0.7), 0.2, 1, windows))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_same_figures_where_the_order_of_addition_matters(dtype: type) -> None:
    """Rows whose sums float64 cannot hold exactly (rates 2**80 apart in magnitude, or
    float64 rates) are added in order, as one model's prefix sums are: the same means to
    the last bit; and a model whose savings scale to a forecast gets its own window's
    order statistics."""
    from gearshift.policies.forecast import Forecast

    rng = np.random.default_rng(7)
    models, steps = 40, 120
    axis = T0 + STEP_S * np.arange(steps)
    rates = rng.lognormal(1.0, 1.0, (models, steps))
    rates[::2] *= 2.0 ** rng.integers(-40, 40, (models // 2, steps))
    rates = rates.astype(dtype)
    names = [f"m{i}" for i in range(models)]
    now = float(axis[-1]) + 1.0
    fc = Forecast(status="ok", method="seasonal", sustained_rps=2.0, peak_rps=5.0,
                  horizon_s=3600.0, quantile=0.1, reason="", points=20, path_ts=(),
                  path_low=(), path_high=(), start_ts=now)
    wanted = {m: FleetModel(FACTS, [], fc if i % 3 else None) for i, m in enumerate(names)}
    fleet = compute_fleet_signals(axis, [(names, rates)], wanted, now, SETTINGS, STEP_S)
    for i, m in enumerate(names):
        one = compute_signals(m, ModelHistory.of(axis, rates[i], [], STEP_S), FACTS, now,
                              SETTINGS, wanted[m].forecast)
        assert fleet[m] == one
        assert (fleet[m].rps_peak, fleet[m].rps_sustained, fleet[m].traffic_scale) == (
            one.rps_peak, one.rps_sustained, one.traffic_scale)


def test_a_forecast_made_after_now_is_refused() -> None:
    from gearshift.policies.forecast import Forecast

    history = _fleet(1, 3, 20, 0.0)
    fc = Forecast(status="ok", method="seasonal", sustained_rps=1.0, peak_rps=2.0,
                  horizon_s=3600.0, quantile=0.1, reason="", points=20,
                  path_ts=(T0 + 30 * STEP_S,), path_low=(1.0,), path_high=(2.0,),
                  start_ts=T0 + 30 * STEP_S)
    with pytest.raises(ValueError, match="after now"):
        compute_fleet_signals(history.axis(), history.blocks(), {"m0": FleetModel(FACTS, [], fc)},
                              T0 + 10 * STEP_S, SETTINGS, STEP_S)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), steps=st.integers(1, 600))
def test_live_mean_replicas_are_the_replay_prefix_sums_to_the_last_bit(seed: int,
                                                                       steps: int) -> None:
    """A live tick counts a window's replicas directly; a replay reads prefix sums over
    the whole series: the same figures."""
    rng = np.random.default_rng(seed)
    step_s, now = 300.0, 1_800_000_000.0
    ts = now - step_s * np.arange(steps, 0, -1)
    rps = rng.lognormal(1.0, 1.5, steps)
    settings_ = SignalSettings(window_s=step_s * 50, long_window_s=step_s * 300)
    facts = ModelFacts(gpus_per_replica=1)
    live = compute_signals("m", ModelHistory.of(ts, rps, [], step_s), facts, now, settings_)
    replay = compute_signals("m", ModelHistory.of(ts, rps, [], step_s, replay=True), facts, now,
                             settings_)
    windows = [(n, 1.0) for n in (live.long_window_samples, live.window_samples, 7, 1)]
    assert live.replica_means((0.7, 3.0, 11.6), 0.2, 1, windows) == \
        replay.replica_means((0.7, 3.0, 11.6), 0.2, 1, windows)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 260), at=st.floats(1.0, 270.0))
def test_signals_of_the_stored_rates_are_within_a_float32_of_the_reported_ones(
        seed: int, steps: int, at: float) -> None:
    """The live history keeps rates as float32: each rate figure is within 2**-24
    (relative, the float32's rounding) of the one computed from the reported float64
    rates, and the window sample counts are the same."""
    rng = np.random.default_rng(seed)
    rates = rng.lognormal(1.0, 1.5, (3, steps))
    ts = T0 + STEP_S * np.arange(steps)
    history = RateHistory(STEP_S, retention_s=300 * STEP_S)
    history.extend_many({f"m{i}": (ts, rates[i]) for i in range(3)})
    now = T0 + at * STEP_S
    wanted = {f"m{i}": FleetModel(FACTS, []) for i in range(3)}
    fleet = compute_fleet_signals(history.axis(), history.blocks(), wanted, now, SETTINGS, STEP_S)
    tolerance = 2.0**-24 * (1 + 1e-9)  # and float64 rounding of the sums
    for i in range(3):
        exact = compute_signals(f"m{i}", ModelHistory.of(ts, rates[i], [], STEP_S), FACTS, now,
                                SETTINGS)
        mine = fleet[f"m{i}"]
        assert (mine.window_samples, mine.long_window_samples) == (
            exact.window_samples, exact.long_window_samples)
        for name in ("rps_current", "rps_mean", "rps_peak", "rps_sustained"):
            got, want = getattr(mine, name), getattr(exact, name)
            assert (got is None) == (want is None)
            if want is not None:
                assert abs(got - want) <= tolerance * want, name


def _priced_facts(rng: np.random.Generator, level: float, boundary: float | None,
                  dtype: type, on_step: bool) -> ModelFacts:
    """Two engines a savings estimate prices (capacity and cold start), at capacities
    near the model's rates (so that its counts cross replica boundaries), and one with a
    capacity but no cold start (never priced). With `boundary`, a rate r at which
    r * (1 + headroom) / capacity rounds to just above 3 (the epsilon of
    `costmodel.replicas` keeps it at 3), or (`on_step`) the lowest rate of `dtype` that
    needs 3 replicas where possible."""
    headroom = float(rng.choice([0.0, 0.2, 0.35]))
    hfac = 1 + headroom
    vllm = float(level * rng.choice([0.3, 0.8, 1.0, 1.5, 40.0]))
    if boundary is not None and not on_step:
        vllm = math.nextafter(boundary * hfac / 3, 0)
    elif boundary is not None:
        below = float(np.nextafter(dtype(boundary), dtype(0)))
        vllm = boundary * hfac / (2 + REPLICA_EPSILON)
        for _ in range(64):  # the count steps from 2 to 3 at the boundary
            if replicas(boundary, vllm, headroom, 0) == 3 and replicas(below, vllm, headroom,
                                                                         0) == 2:
                break
            vllm = math.nextafter(vllm, 0 if replicas(boundary, vllm, headroom, 0) < 3
                                  else math.inf)
    return ModelFacts(
        gpus_per_replica=1, min_replicas=int(rng.integers(0, 3)),
        headroom=headroom, price_per_gpu_hour=4.0,
        engines={"vllm": EngineFacts(capacity_rps=vllm, cold_start_s=210.0),
                 "tensorrt-llm": EngineFacts(capacity_rps=vllm * 1.16, cold_start_s=240.0,
                                             build_s=1800.0),
                 "sglang": EngineFacts(capacity_rps=vllm * 0.9)})


def _estimate(estimate: Any, *args: Any) -> Any:
    """An estimate, or the error it raised (a rate too large to price)."""
    try:
        return estimate(*args)
    except CostModelError as exc:
        return str(exc)


def _priced_fleet(seed: int, models: int, steps: int, gap_share: float, at: float,
                  float32: bool) -> tuple[list[str], dict[str, FleetModel], dict[str, Any],
                                          dict[str, Any]]:
    """A fleet whose savings estimates cross replica boundaries or sit on them, with idle
    models, gaps, float32 or float64 rates, forecasts that scale the short window and rates
    too large to price: (names, wanted, the fleet's signals, each model's own signals)."""
    from gearshift.policies.forecast import Forecast

    rng = np.random.default_rng(seed)
    now = T0 + at * STEP_S
    axis = T0 + STEP_S * np.arange(steps)
    levels = rng.lognormal(1.0, 1.0, models)
    rates = levels[:, None] * rng.uniform(0.6, 1.4, (models, steps))
    rates[::9] = 0.0  # idle
    rates[1::13] = 1e14 * levels[1::13, None]  # counts past MAX_EXACT_COUNT: not priced
    rates[rng.random((models, steps)) < gap_share] = np.nan
    dtype = np.float32 if float32 else np.float64
    rates = rates.astype(dtype)
    names = [f"m{i}" for i in range(models)]

    def forecast(k: int) -> Forecast | None:
        if k % 3:
            return None
        return Forecast(status="ok", method="seasonal", sustained_rps=float(levels[k] * 0.7),
                        peak_rps=float(levels[k] * 2), horizon_s=3600.0, quantile=0.1,
                        reason="", points=20, path_ts=(), path_low=(), path_high=(),
                        start_ts=min(now, T0))

    if steps:  # every fifth rate of every seventh model on a replica boundary
        rates[2::7, ::5] = rates[2::7, :1]
    wanted = {m: FleetModel(_priced_facts(rng, float(levels[k]), float(rates[k, 0])
                                          if k % 7 == 2 and steps and rates[k, 0] > 0 else None,
                                          dtype, k % 2 == 0),
                            [], forecast(k))
              for k, m in enumerate(names)}
    blocks = [(names[b:b + 64], rates[b:b + 64]) for b in range(0, models, 64)]
    fleet = compute_fleet_signals(axis, blocks, wanted, now, SETTINGS, STEP_S)
    ones = {}
    for k, m in enumerate(names):
        have = ~np.isnan(rates[k])
        ones[m] = compute_signals(m, ModelHistory.of(axis[have], rates[k][have], [], STEP_S),
                                  wanted[m].facts, now, SETTINGS, wanted[m].forecast)
    return names, wanted, fleet, ones


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), models=st.integers(1, 300), steps=st.integers(0, 260),
       gap_share=st.sampled_from([0.0, 0.0, 0.01, 0.3]), at=st.floats(-5.0, 270.0),
       float32=st.booleans())
def test_the_same_savings_estimates_as_model_by_model(seed: int, models: int, steps: int,
                                                      gap_share: float, at: float,
                                                      float32: bool) -> None:
    """Every savings estimate a tick makes from the fleet's signals, and the replica counts
    under it (`Signals.replica_means`, as the cost rule asks and otherwise), are those of
    each model's own history, to the last bit: rates crossing replica boundaries or on
    them, idle models, gaps, float32 or float64 rates, forecasts that scale the short
    window, rates too large to price."""
    from gearshift.policies.economics import CostSettings, estimate_move

    names, wanted, fleet, ones = _priced_fleet(seed, models, steps, gap_share, at, float32)
    cost = CostSettings(price_per_gpu_hour=None, build_overhead_usd={}, horizon_s=7 * 86400.0,
                        hysteresis=0.5)
    for m in names:
        fm = wanted[m]
        one = ones[m]
        mine = fleet[m]
        for current, target in (("vllm", "tensorrt-llm"), ("tensorrt-llm", "vllm"),
                                ("vllm", "sglang")):
            assert (_estimate(estimate_move, mine, current, target, cost)
                    == _estimate(estimate_move, one, current, target, cost))
        caps = tuple(e.capacity_rps for e in fm.facts.engines.values()
                     if e.capacity_rps is not None)
        for windows in (((one.window_samples, one.traffic_scale), (one.long_window_samples, 1.0)),
                        ((one.long_window_samples, 1.0),), ((one.window_samples, 1.3),)):
            for capacities in (caps, caps[::-1], (0.5, *caps)):
                args = (capacities, fm.facts.headroom, fm.facts.min_replicas, windows)
                assert mine.replica_means(*args) == one.replica_means(*args)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), models=st.integers(1, 300), steps=st.integers(0, 260),
       gap_share=st.sampled_from([0.0, 0.0, 0.01, 0.3]), at=st.floats(-5.0, 270.0),
       float32=st.booleans(), price=st.sampled_from([None, 2.5]),
       overhead=st.sampled_from([{}, {"tensorrt-llm": 7.0}]))
def test_the_same_fleet_estimates_as_model_by_model(seed: int, models: int, steps: int,
                                                    gap_share: float, at: float, float32: bool,
                                                    price: float | None,
                                                    overhead: dict[str, float]) -> None:
    """The savings estimates of every model at once (`estimate_fleet_moves`, as a live tick
    makes them) are `estimate_move`'s on each model's own history, to the last bit, from
    either engine to every other; an estimate it leaves out is one `estimate_move` refuses
    (a rate too large to price)."""
    from gearshift.policies.economics import CostSettings, estimate_move
    from gearshift.policies.fleet_estimates import estimate_fleet_moves

    names, _, fleet, ones = _priced_fleet(seed, models, steps, gap_share, at, float32)
    cost = CostSettings(price_per_gpu_hour=price, build_overhead_usd=overhead,
                        horizon_s=7 * 86400.0, hysteresis=0.5)
    engines = {m: ("vllm", "tensorrt-llm", "sglang")[k % 3] for k, m in enumerate(names)}
    found = estimate_fleet_moves(fleet, engines, cost)
    assert set(found) == set(names)
    for m in names:
        for target in ("vllm", "tensorrt-llm", "sglang"):
            if target == engines[m]:
                assert target not in found[m]
                continue
            expected = _estimate(estimate_move, ones[m], engines[m], target, cost)
            if target in found[m]:
                assert found[m][target] == expected
                assert repr(found[m][target]) == repr(expected)  # -0.0 and 0.0 apart
            else:
                assert isinstance(expected, str)  # refused: estimated (and raised) by decide
