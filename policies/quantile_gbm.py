"""scikit-learn's quantile gradient boosting, the reference of the forecast's trees.

The forecast grows its trees in numpy (`policies.quantile_trees`, scikit-learn's
trees bit for bit, without importing scikit-learn). `quantile_regressor` is the
estimator those trees are pinned to (tests compare every array on each supported
scikit-learn release) and the one the forecast falls back to for the inputs the
numpy trees do not cover; it is scikit-learn's public
`HistGradientBoostingRegressor(loss="quantile")`.

`flat_trees` copies a fitted estimator's trees (its `_predictors` and
`_baseline_prediction` attributes: scikit-learn has no public accessor for them)
into the compact `forecast_model.FlatTrees` that a forecast keeps between fits; a
test checks its predictions against the estimator's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sklearn.ensemble import HistGradientBoostingRegressor

from gearshift.policies.forecast_model import FlatTrees


def quantile_regressor(**params: Any) -> HistGradientBoostingRegressor:
    """A quantile `HistGradientBoostingRegressor` with `params` (loss="quantile" implied)."""
    return HistGradientBoostingRegressor(**{**params, "loss": "quantile"})


def flat_trees(model: HistGradientBoostingRegressor) -> FlatTrees:
    """A fitted single-output regressor's trees as `FlatTrees` (the same predictions: a
    test compares them with `model.predict`)."""
    nodes = [predictors[0].nodes for predictors in model._predictors]
    sizes = np.array([n.size for n in nodes])
    if sizes.sum() > np.iinfo(np.int16).max:
        raise ValueError(f"{sizes.sum()} nodes do not fit FlatTrees' int16 indices")
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    every = np.concatenate(nodes)
    base = np.repeat(offsets, sizes)
    leaf = every["is_leaf"].astype(bool)
    if every["is_categorical"].any():
        raise ValueError("FlatTrees has no categorical splits")
    index = np.arange(every.size)
    left = np.where(leaf, index, every["left"] + base)
    right = np.where(leaf, index, every["right"] + base)
    return FlatTrees(
        baseline=float(np.asarray(model._baseline_prediction).ravel()[0]),
        roots=offsets.astype(np.intp),
        feature=np.where(leaf, 0, every["feature_idx"]).astype(np.int8),
        value=np.where(leaf, every["value"], every["num_threshold"]),
        left=left.astype(np.int16), right=right.astype(np.int16),
        missing=np.where(every["missing_go_to_left"].astype(bool), left, right).astype(np.int16),
        depth=int(every["depth"].max()))
