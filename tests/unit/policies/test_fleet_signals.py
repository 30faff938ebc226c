"""Every model's signals at once (`compute_fleet_signals`) are exactly those that
`compute_signals` gives each model from its own samples: gaps, windows, revisions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gearshift.controller.rate_history import RateHistory
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
