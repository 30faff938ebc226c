"""A policy tick fits forecasts within a budget, stalest first, and reads the rest
from the cache: a large fleet is refreshed over several ticks, never all in one."""

from __future__ import annotations

import threading
import time

from gearshift.controller.decisions.learning import FORECAST_REFIT_S, Forecaster

NOW = 1_800_000_000.0
STEP_S = 300.0
HORIZON_S = 86400.0


def _forecaster() -> Forecaster:
    def history(model: str) -> tuple[list[float], list[float]]:
        level = float(model.split("-")[1])
        return ([NOW - k * STEP_S for k in range(48, 0, -1)], [level] * 47 + [level + 1])
    return Forecaster(history, STEP_S, clock=lambda: NOW)


def _cached(f: Forecaster, models: list[str], now: float) -> list[bool]:
    return [f.cached(m, now, horizon_s=HORIZON_S, quantile=0.1) is not None for m in models]


def test_a_zero_budget_fits_one_model_per_tick_never_forecast_ones_first() -> None:
    f, models = _forecaster(), ["m-1", "m-2", "m-3"]
    assert _cached(f, models, NOW) == [False, False, False]
    assert f.refresh(models, NOW, horizon_s=HORIZON_S, quantile=0.1, budget_s=0.0) == 1
    assert _cached(f, models, NOW) == [True, False, False]
    assert f.refresh(models, NOW, horizon_s=HORIZON_S, quantile=0.1, budget_s=0.0) == 1
    assert f.refresh(models, NOW, horizon_s=HORIZON_S, quantile=0.1, budget_s=0.0) == 1
    assert _cached(f, models, NOW) == [True, True, True]
    assert f.refresh(models, NOW, horizon_s=HORIZON_S, quantile=0.1, budget_s=0.0) == 0
    fc = f.cached("m-2", NOW, horizon_s=HORIZON_S, quantile=0.1)
    assert fc is not None and fc.status == "ok" and fc.sustained_rps is not None


def test_stale_forecasts_are_refitted_oldest_first_and_read_meanwhile() -> None:
    f, models = _forecaster(), ["m-1", "m-2"]
    f.refresh(["m-2"], NOW, horizon_s=HORIZON_S, quantile=0.1)
    f.refresh(["m-1"], NOW + 60, horizon_s=HORIZON_S, quantile=0.1)
    later = NOW + 60 + FORECAST_REFIT_S
    old = f.cached("m-1", later, horizon_s=HORIZON_S, quantile=0.1)
    assert old is not None  # stale, still read until refitted
    assert f.refresh(models, later, horizon_s=HORIZON_S, quantile=0.1, budget_s=0.0) == 1
    refitted = f.cached("m-2", later, horizon_s=HORIZON_S, quantile=0.1)
    assert refitted is not None and refitted.start_ts == later  # m-2, the oldest, went first
    assert f.cached("m-1", later, horizon_s=HORIZON_S, quantile=0.1) is old
    assert old.start_ts == NOW + 60
    # Another horizon is another forecast: none is made for it until refreshed.
    assert f.cached("m-1", later, horizon_s=2 * HORIZON_S, quantile=0.1) is None


def test_a_generous_budget_refreshes_a_small_fleet_whole() -> None:
    f, models = _forecaster(), [f"m-{i}" for i in range(5)]
    assert f.refresh(models, NOW, horizon_s=HORIZON_S, quantile=0.1, budget_s=60.0) == 5


def _background(share: float = 1.0) -> Forecaster:
    def history(model: str) -> tuple[list[float], list[float]]:
        level = float(model.split("-")[1])
        return ([NOW - k * STEP_S for k in range(48, 0, -1)], [level] * 47 + [level + 1])
    return Forecaster(history, STEP_S, clock=lambda: NOW, background=True, worker_cpu_share=share)


def _wait_for(f: Forecaster, models: list[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(_cached(f, models, NOW)) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_worker_thread_fits_what_a_tick_hands_off_with_the_same_forecasts() -> None:
    """The live controller's forecasts are fitted off the tick: the same figures as a fit
    in the tick, each model once, and nothing due once all are fresh."""
    models = ["m-1", "m-2", "m-3"]
    f = _background()
    try:
        assert f.hand_off(models, NOW, horizon_s=HORIZON_S, quantile=0.1) == 3
        _wait_for(f, models)
        assert all(_cached(f, models, NOW))
        assert f.worker_stats()[0] == 3
        assert f.hand_off(models, NOW + 60, horizon_s=HORIZON_S, quantile=0.1) == 0
    finally:
        f.close()
    inline = _forecaster()
    inline.refresh(models, NOW, horizon_s=HORIZON_S, quantile=0.1, budget_s=60.0)
    for m in models:
        assert f.cached(m, NOW, horizon_s=HORIZON_S, quantile=0.1) == \
            inline.cached(m, NOW, horizon_s=HORIZON_S, quantile=0.1)


def test_a_held_worker_starts_no_fit_until_the_next_hand_off() -> None:
    """A tick holds the worker: the fit under way ends, no other starts until the tick's
    hand-off."""
    fitting, release = threading.Event(), threading.Event()

    def history(model: str) -> tuple[list[float], list[float]]:
        if model == "m-1":  # the fit under way when the tick starts
            fitting.set()
            release.wait(10.0)
        return ([NOW - k * STEP_S for k in range(48, 0, -1)], [5.0] * 48)

    f = Forecaster(history, STEP_S, clock=lambda: NOW, background=True, worker_cpu_share=1.0)
    try:
        f.hand_off(["m-1", "m-2"], NOW, horizon_s=HORIZON_S, quantile=0.1)
        assert fitting.wait(10.0)
        f.hold()
        release.set()
        _wait_for(f, ["m-1"])
        time.sleep(0.3)
        assert _cached(f, ["m-1", "m-2"], NOW) == [True, False]
        assert f.hand_off(["m-1", "m-2"], NOW, horizon_s=HORIZON_S, quantile=0.1) == 1
        _wait_for(f, ["m-2"])
        assert _cached(f, ["m-2"], NOW) == [True]
    finally:
        f.close()
