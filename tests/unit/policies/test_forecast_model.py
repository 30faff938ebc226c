"""Kept forecast trees: a forecast hands its fitted trees to the next one, which predicts
from the current history with them until a refit is due, by one cadence for the blind
backtest and the controller's forecasts."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from gearshift.controller.decisions.learning import Forecaster
from gearshift.policies.blind import BlindLearner, blind_view
from gearshift.policies.forecast import SECONDS_PER_DAY, forecast_rate
from gearshift.policies.forecast_features import daily_level, features, grid_means
from gearshift.policies.forecast_model import MODEL_REFIT_GROWTH, MODEL_REFIT_S
from gearshift.policies.loader import load_policy_file
from gearshift.policies.signals import ModelHistory
from gearshift.policies.trace import read_trace

from .test_forecast import HORIZON_S, START, STEP_S, seasonal

EXAMPLES = Path(__file__).parents[3] / "policies" / "examples"
TRACES = Path(__file__).parent / "traces"


def _at(days: float) -> float:
    return START + days * SECONDS_PER_DAY


def test_kept_trees_give_the_fresh_fit_when_the_history_has_not_changed() -> None:
    ts, rps = seasonal(16)
    fresh = forecast_rate(ts, rps, _at(15), HORIZON_S, step_s=STEP_S)
    again = forecast_rate(ts, rps, _at(15), HORIZON_S, step_s=STEP_S, kept=fresh.model)
    assert fresh.method == "seasonal-gbm" and fresh.model is not None
    assert again.model is fresh.model  # not refitted
    assert asdict(again) == asdict(fresh)
    # Small enough for a controller to keep one per model of a 10,000-model fleet.
    assert fresh.model.nbytes < 10_000


def test_kept_trees_predict_from_the_current_history() -> None:
    """The trees learned log ratios to the daily level: applied to a history whose level
    tripled since the fit, the kept trees forecast about three times the rate."""
    ts, rps = seasonal(16)
    fitted = forecast_rate(ts, rps, _at(12), HORIZON_S, step_s=STEP_S)
    tripled = np.where(ts >= _at(12), 3 * rps, rps)
    later = forecast_rate(ts, tripled, _at(15), HORIZON_S, step_s=STEP_S, kept=fitted.model)
    same_level = forecast_rate(ts, rps, _at(15), HORIZON_S, step_s=STEP_S, kept=fitted.model)
    assert later.model is fitted.model and same_level.model is fitted.model
    assert later.start_ts == _at(15)
    assert later.sustained_rps == pytest.approx(3 * same_level.sustained_rps, rel=0.15)


def test_trees_are_refitted_when_due_and_not_before() -> None:
    ts, rps = seasonal(40)
    first = forecast_rate(ts, rps, _at(29), HORIZON_S, step_s=STEP_S)
    assert first.model is not None and first.model.fitted_at == _at(29)

    def model_at(days: float, **kwargs: float) -> object:
        fc = forecast_rate(ts, rps, _at(days), kwargs.pop("horizon_s", HORIZON_S),
                           step_s=STEP_S, kept=first.model, **kwargs)
        return fc.model

    week = MODEL_REFIT_S / SECONDS_PER_DAY
    assert model_at(29 + week - 1 / 24) is first.model  # a day short of due: kept
    assert model_at(29 + week).fitted_at == _at(29 + week)  # type: ignore[attr-defined]
    # A forecast before the fit must not use trees that saw later samples.
    assert model_at(28).fitted_at == _at(28)  # type: ignore[attr-defined]
    # Another horizon or quantile is another model.
    assert model_at(29.5, horizon_s=2 * HORIZON_S) is not first.model
    assert model_at(29.5, quantile=0.2) is not first.model


def test_trees_that_no_longer_fit_the_latest_day_are_refitted() -> None:
    """A drop the ratios did not foresee (the rate falls to a third): most of the next
    day's rates fall below the kept low model, so it is refitted before it is due; the
    same history without the drop keeps it."""
    ts, rps = seasonal(16)
    fitted = forecast_rate(ts, rps, _at(12), HORIZON_S, step_s=STEP_S)
    dropped = np.where(ts >= _at(12.5), rps / 3, rps)
    later = forecast_rate(ts, dropped, _at(13.5), HORIZON_S, step_s=STEP_S, kept=fitted.model)
    assert later.model is not None and later.model.fitted_at == _at(13.5)
    same = forecast_rate(ts, rps, _at(13.5), HORIZON_S, step_s=STEP_S, kept=fitted.model)
    assert same.model is fitted.model


def test_a_young_model_is_refitted_as_its_training_rows_double() -> None:
    """The seasonal model starts at 2 days of history, with a day of rows with a known
    day lag; its trees are refitted once those rows have grown MODEL_REFIT_GROWTH
    (2) times, not at every forecast."""
    assert MODEL_REFIT_GROWTH == 2.0
    ts, _ = seasonal(10)
    # The same cycle every day, little noise: trees fitted on one day fit the next
    # (no drift), so only the growth refits them.
    rps = 100 * (1 + 0.5 * np.sin(2 * np.pi * (ts % SECONDS_PER_DAY) / SECONDS_PER_DAY))
    rps *= np.random.default_rng(1).lognormal(0, 0.03, ts.size)
    kept, fitted_at = None, []
    for hours in range(36, 10 * 24, 6):
        fc = forecast_rate(ts, rps, _at(hours / 24), HORIZON_S, step_s=STEP_S, kept=kept)
        if fc.model is not kept and fc.model is not None:
            fitted_at.append(hours / 24)
        kept = fc.model
    assert fitted_at == [2.0, 3.0, 5.0, 9.0]  # 1, 2, 4, 8 days of rows


def test_the_blind_backtest_and_the_controller_refit_at_the_same_times() -> None:
    policy = load_policy_file(str(EXAMPLES / "default.yaml"))
    view = blind_view(read_trace(TRACES / "steady-70b.jsonl.gz"))
    model = next(iter(view.series))
    start = view.start.timestamp()
    ts = start + view.step_s * np.arange(view.n_steps, dtype=np.float64)
    rps = np.asarray(view.series[model].rps, dtype=np.float64)
    history = ModelHistory.of(ts, rps, np.array([]), view.step_s, replay=True)
    spec = policy.doc.spec
    learner = BlindLearner(policy, view)
    live = Forecaster(lambda _: (ts, rps), view.step_s)
    blind_fits, live_fits = [], []
    for day in range(8, int(view.n_steps * view.step_s / SECONDS_PER_DAY)):
        now = start + day * SECONDS_PER_DAY
        backtest = learner.forecast(model, history, now)
        controller = live.forecast(model, now, horizon_s=spec.cost.horizon,
                                   quantile=spec.signals.sustained_quantile)
        assert asdict(controller) == asdict(backtest)
        blind_fits.append(None if backtest.model is None else backtest.model.fitted_at)
        live_fits.append(None if controller.model is None else controller.model.fitted_at)
    assert blind_fits == live_fits
    assert 1 < len(set(blind_fits)) < len(blind_fits)  # refitted, but not every day


@pytest.mark.parametrize(("start", "stop"), [(0, None), (0, 100), (3000, None), (8063, 8100),
                                             (9000, None), (5, 6)])
def test_feature_rows_are_those_of_the_whole_matrix(start: int, stop: int | None) -> None:
    """Kept trees predict from the features of the last rows only: each row must be the
    whole matrix's to the bit (gaps, and so NaN features, included)."""
    ts, rps = seasonal(30)
    rps = np.where((ts % (5 * SECONDS_PER_DAY)) < 4 * 3600, np.nan, rps)  # gaps
    now, bin_s, day_lag, week_lag = _at(29), STEP_S, 288, 2016
    past, future = 8064, 2016
    keep = np.isfinite(rps) & (ts < now)
    grid = grid_means(ts[keep], rps[keep], now, bin_s, past, future)
    day_mean, level = daily_level(grid, bin_s, day_lag)
    bin_ts = now + bin_s * np.arange(-past, future, dtype=np.float64)
    whole = features(grid, bin_ts, bin_s, day_mean, level, day_lag, week_lag)
    part = features(grid, bin_ts, bin_s, day_mean, level, day_lag, week_lag, start, stop)
    assert np.isnan(whole).any()
    np.testing.assert_array_equal(part, whole[start:stop])
    assert part.tobytes() == whole[start:stop].tobytes()
