"""The numpy-grown quantile trees are scikit-learn's, and the capacity fit's PAVA is
SciPy's, to the last bit (`test_backtest` checks that a blind backtest imports neither
library). These tests pin `policies.quantile_trees` to the installed scikit-learn; run
them on each release pyproject.toml allows when that range changes (`make test-sklearn`)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import isotonic_regression

from gearshift.policies import forecast_model
from gearshift.policies.capacity_fit import isotonic_fit
from gearshift.policies.forecast import decision_forecast
from gearshift.policies.forecast_model import (
    FIT_LEARNING_RATE,
    FIT_LEAVES,
    FIT_MIN_SAMPLES_LEAF,
    FIT_ROUNDS,
    FlatTrees,
    fit_trees,
    fit_trees_sklearn,
)
from gearshift.policies.quantile_trees import fit_quantile_trees


def _numpy_trees(x: np.ndarray, y: np.ndarray, q: float) -> FlatTrees | None:
    return fit_quantile_trees(x, y, q, rounds=FIT_ROUNDS, learning_rate=FIT_LEARNING_RATE,
                              max_leaves=FIT_LEAVES, min_samples_leaf=FIT_MIN_SAMPLES_LEAF)


def _assert_same_trees(a: FlatTrees, b: FlatTrees) -> None:
    assert np.float64(a.baseline).tobytes() == np.float64(b.baseline).tobytes()
    assert a.depth == b.depth
    for name in ("roots", "feature", "left", "right", "missing"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert a.value.tobytes() == b.value.tobytes()  # every threshold and leaf, bit for bit


def _data(kind: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(60, 1500))
    f = int(rng.integers(1, 8))
    x = rng.normal(size=(n, f))
    if kind == "rounded":      # ties and few distinct values: midpoint thresholds
        x = np.round(x, 1)
    elif kind == "missing":    # NaN: both scans, missing values routed either way
        x[rng.random((n, f)) < 0.15] = np.nan
    elif kind == "integers":   # a handful of values, ties in the targets too
        x = rng.integers(0, 5, (n, f)).astype(float)
    elif kind == "constant":   # a column that never splits
        x[:, 0] = 1.0
    y = np.sin(np.nan_to_num(x[:, -1])) + 0.3 * rng.standard_t(3, size=n)
    if kind == "integers":
        y = np.round(y, 1)
    return x, y


@pytest.mark.parametrize("kind", ["normal", "rounded", "missing", "integers", "constant"])
@pytest.mark.parametrize("seed", range(6))
def test_trees_are_the_estimators_bit_for_bit(kind: str, seed: int) -> None:
    x, y = _data(kind, seed)
    for q in (0.1, 0.5, 0.9):
        trees = _numpy_trees(x, y, q)
        assert trees is not None
        _assert_same_trees(trees, fit_trees_sklearn(x, y, q))


def test_few_rows_give_one_leaf_trees_as_the_estimator_does() -> None:
    rng = np.random.default_rng(7)
    for n in (1, 2, 39, 40, 79, 80, 81):
        x, y = rng.normal(size=(n, 3)), rng.normal(size=n)
        trees = _numpy_trees(x, y, 0.9)
        assert trees is not None
        _assert_same_trees(trees, fit_trees_sklearn(x, y, 0.9))


def test_inputs_it_does_not_follow_go_to_the_estimator() -> None:
    rng = np.random.default_rng(8)
    x, y = rng.normal(size=(200, 2)), rng.normal(size=200)
    y_nan = y.copy()
    y_nan[3] = np.nan
    only_nan = x.copy()
    only_nan[:, 1] = np.where(rng.random(200) < 0.3, np.nan, 2.0)  # constant but for NaN
    assert _numpy_trees(x, y_nan, 0.5) is None
    assert _numpy_trees(only_nan, y, 0.5) is None
    # fit_trees falls back to scikit-learn there, with the estimator's trees.
    _assert_same_trees(fit_trees(only_nan, y, 0.5), fit_trees_sklearn(only_nan, y, 0.5))


def test_forecasts_are_those_of_the_estimators_trees(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seasonal forecast end to end (its own feature matrices, refits, the peak
    model) gives the same figures with either fit."""
    rng = np.random.default_rng(9)
    step = 300.0
    ts = np.arange(0, 9 * 86400, step)
    daily = 1 + 0.6 * np.sin(2 * np.pi * ts / 86400)
    rps = np.maximum(0.0, 20 * daily * (1 + ts / 86400 / 20) + rng.normal(0, 2, ts.size))
    keep = rng.random(ts.size) > 0.03  # gaps in the history: missing features
    keep[int(4 * 86400 / step):int(4.2 * 86400 / step)] = False
    ts, rps = ts[keep], rps[keep]
    nows = [3 * 86400.0, 5 * 86400.0 + 1234.0, 8.5 * 86400]

    def forecasts() -> list[tuple[object, ...]]:
        out = []
        for now in nows:
            for horizon_s in (3600.0, 86400.0):
                fc = decision_forecast(ts, rps, now, horizon_s, step_s=step, quantile=0.2)
                out.append((fc.method, fc.sustained_rps, fc.peak_rps))
        return out

    mine = forecasts()
    assert all(m[0] == "seasonal-gbm" for m in mine)
    monkeypatch.setattr(forecast_model, "fit_trees", fit_trees_sklearn)
    assert forecasts() == mine


@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.floats(0, 1e4, allow_nan=False) | st.sampled_from([0.1, 0.2, 0.3]),
                       min_size=0, max_size=120))
def test_isotonic_fit_is_scipys_bit_for_bit(values: list[float]) -> None:
    mine = np.array(isotonic_fit(values), dtype=np.float64)
    if len(values) == 0:
        assert mine.size == 0
        return
    theirs = isotonic_regression(np.array(values), increasing=True).x
    assert mine.tobytes() == theirs.tobytes()


def test_isotonic_fit_on_long_runs_and_ties() -> None:
    rng = np.random.default_rng(10)
    for y in (np.arange(300.0)[::-1], np.full(50, 0.1), np.round(rng.lognormal(size=500), 1),
              np.concatenate([np.linspace(5, 1, 100), np.linspace(0, 9, 100)]) + 0.1):
        assert np.array(isotonic_fit(y.tolist())).tobytes() == \
            isotonic_regression(y, increasing=True).x.tobytes()
