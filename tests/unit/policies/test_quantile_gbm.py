"""scikit-learn's quantile estimator as the forecast reads it: `flat_trees` predicts its
figures, a constant or repeated column changes no tree, and the numpy trees' leaf
quantile is numpy's percentile."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from gearshift.policies.forecast_model import TABLE_MAX_SPLITS
from gearshift.policies.quantile_gbm import flat_trees, quantile_regressor
from gearshift.policies.quantile_trees import percentile_linear


@given(values=st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=400),
       quantile=st.sampled_from([0.01, 0.1, 0.25, 0.5, 0.9, 0.99, 0.3333]))
def test_percentile_is_numpys_bit_for_bit(values: list[float], quantile: float) -> None:
    arr = np.array(values)
    assert percentile_linear(arr.copy(), quantile) == np.percentile(arr, 100 * quantile)


def test_constant_and_repeated_columns_change_no_tree() -> None:
    """The forecast drops them before fitting (`forecast_features.split_columns`): a constant
    column never splits and a copy of an earlier column loses every tie to it."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2000, 3))
    x[rng.random(2000) < 0.05, 2] = np.nan  # missing values go the same way in both copies
    y = np.sin(x[:, 0]) + 0.3 * np.nan_to_num(x[:, 2]) + rng.standard_t(3, size=2000)
    padded = np.column_stack([x[:, 0], x[:, 1], x[:, 2], np.zeros(2000), x[:, 2], x[:, 0]])
    params = {"max_iter": 30, "max_leaf_nodes": 15, "min_samples_leaf": 40,
              "early_stopping": False, "random_state": 0}
    for q in (0.1, 0.9):
        lean = quantile_regressor(quantile=q, **params).fit(x, y)
        full = quantile_regressor(quantile=q, **params).fit(padded, y)
        np.testing.assert_array_equal(lean.predict(x), full.predict(padded))


def test_flat_trees_predict_the_estimators_figures_bit_for_bit() -> None:
    """A forecast keeps its trees as `FlatTrees` and predicts with them at later
    forecasts: the figures must be the estimator's, missing values included. Trees of 2
    and 7 leaves are read through the leaf table, those of 15 leaves (14 splits, over
    `TABLE_MAX_SPLITS`) walked level by level."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(2500, 4))
    x[rng.random(2500) < 0.1, 3] = np.nan
    y = np.sin(x[:, 0]) + 0.5 * np.nan_to_num(x[:, 3], nan=2.0) + rng.standard_t(3, size=2500)
    fresh = rng.normal(size=(700, 4))
    fresh[rng.random(700) < 0.2, 3] = np.nan
    fresh[:5, 0] = np.nan  # never missing in training: scikit-learn sends it down one side
    for leaves, rounds in ((7, 20), (15, 40), (2, 5)):
        assert (leaves - 1 <= TABLE_MAX_SPLITS) == (leaves != 15)  # both ways are taken
        for q in (0.1, 0.9):
            model = quantile_regressor(quantile=q, max_iter=rounds, max_leaf_nodes=leaves,
                                       min_samples_leaf=40, early_stopping=False,
                                       random_state=0).fit(x, y)
            flat = flat_trees(model)
            for rows in (x, fresh, fresh[~np.isnan(fresh).any(axis=1)]):
                np.testing.assert_array_equal(flat.predict(rows), model.predict(rows))
