"""The seasonal forecast's fitted trees, kept between forecasts, and when to refit them.

The trees of `policies.forecast` map features that are relative to the current
history (calendar, the day and week lags as log ratios to the daily level) to a
log ratio, so a fitted pair applies to the features of a later history as well
as to those it was trained on. A forecast therefore keeps its fitted model
(`SeasonalModel`) and the next forecast of the same model (the blind backtest's
daily one, the controller's forecast worker) predicts from the fresh features of
the current history with it, refitting only when due (`SeasonalModel.due`,
`drifted`): after MODEL_REFIT_S; once the training rows (bins with a known day lag) grew MODEL_REFIT_GROWTH times
those it was fitted on (a young model's fits see one day, then two, four,
eight...); when the trees no longer fit the last DRIFT_WINDOW_S of known targets
(the share of them below the low model strays from its quantile by more than
DRIFT_TOLERANCE: a ramp that stopped, a drop); for another horizon, quantile or
bin size; or for an origin before the fit (which could have seen later samples).
Without the drift check a ramp's trees kept forecasting growth for days after it
stopped (`bench/forecast.py` on ramp-70b: improvement 0.11 instead of 0.49 with
a fit at every origin; 0.45 with it). A forecast that fits costs tens of
milliseconds, one from kept trees a few (`policies.forecast` has the figures).

The trees are held as flat arrays (`FlatTrees`: an int8 feature, a float64 and
three int16 child indices per node: 4 KB for 20 trees of 7 leaves; about 10 KB a
model with both quantiles and the Python objects) rather than as scikit-learn's
estimator (26 KB pickled for the same trees, 114 KB for 60 trees of 15 leaves),
so that a controller keeps them for every model of a 10,000-model fleet; the flat
prediction takes every split and every sum in scikit-learn's order, so its
figures are the estimator's to the last bit (tests compare them).

`FIT_ROUNDS` x `FIT_LEAVES` at `FIT_LEARNING_RATE` set the cost of a fit:
scikit-learn's tree grower spends Python time per node, so a fit costs about
rounds x leaves, hardly the rows (docs/cost-model.md has the figures).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from gearshift.policies.forecast_features import SECONDS_PER_DAY, FloatArray

if TYPE_CHECKING:
    from threadpoolctl import ThreadpoolController

FIT_ROUNDS = 20               # boosting rounds per quantile model
FIT_LEAVES = 7                # leaves per tree
FIT_LEARNING_RATE = 0.3
FIT_MIN_SAMPLES_LEAF = 40
MODEL_REFIT_S = 7 * SECONDS_PER_DAY  # kept trees are refitted at least this often ...
MODEL_REFIT_GROWTH = 2.0             # ... and when the training rows grew this many times,
DRIFT_WINDOW_S = SECONDS_PER_DAY     # ... or when over this last stretch of known targets
DRIFT_TOLERANCE = 0.15               # the share below the low model strays this far from its quantile
TABLE_MAX_SPLITS = 8                 # trees of at most this many splits predict by a leaf table


@dataclass(frozen=True, slots=True)
class FlatTrees:
    """A boosted ensemble as flat arrays, one entry per node of every tree. At a split a
    row goes to `left` when its `feature` is <= the split's `value` (the threshold), to
    `missing` when it is NaN, else to `right`; a leaf's `value` is the leaf's, and its
    children are itself (so every row can take `depth` steps, whatever its leaf's
    depth)."""

    baseline: float
    roots: npt.NDArray[np.intp]        # first node of each tree, in boosting order
    feature: npt.NDArray[np.int8]
    value: FloatArray
    left: npt.NDArray[np.int16]
    right: npt.NDArray[np.int16]
    missing: npt.NDArray[np.int16]
    depth: int                         # the deepest leaf's depth

    def predict(self, x: FloatArray) -> FloatArray:
        """Per row: the baseline plus each tree's leaf value, added tree by tree.

        Trees of at most TABLE_MAX_SPLITS splits (the forecast's 7-leaf trees have 6) are
        read through a leaf table (`_leaf_tables`): every split's test on every row at
        once, each row's outcomes in a tree packed into one code, the code's leaf looked
        up. Larger trees are walked level by level (`_walk`). Both take the same
        comparisons and add the same leaves in the same order: the same figures."""
        tables = self._leaf_tables()
        if tables is None:
            return self._walk(x)
        splits, feature, value, missing_right, table = tables
        rows, trees = x.shape[0], self.roots.size
        seen = np.ascontiguousarray(x.T)[feature]  # (tree, split) -> the split's feature
        goes_right = seen > value[:, None]  # NaN compares False: left ...
        missing = np.isnan(seen)
        if missing.any():
            goes_right |= missing & missing_right[:, None]  # ... unless missing goes right
        outcome = goes_right.view(np.uint8).reshape(trees, splits, rows)
        code = np.zeros((trees, rows), dtype=np.uint8)
        for split in range(splits):
            code |= outcome[:, split] << split
        leaves = table.ravel().take(code + (np.arange(trees, dtype=np.intp) << splits)[:, None])
        return self._sum(leaves)

    def _walk(self, x: FloatArray) -> FloatArray:
        """`predict` by walking every (tree, row) down one level at a time."""
        rows, trees = x.shape[0], self.roots.size
        by_feature = np.ascontiguousarray(x.T).ravel()  # feature f of row r at f * rows + r
        offset = self.feature.astype(np.intp) * rows
        children = np.column_stack([self.left, self.right, self.missing]).astype(np.intp).ravel()
        row = np.tile(np.arange(rows, dtype=np.intp), trees)
        node = np.repeat(self.roots, rows)  # tree-major: (tree, row)
        has_nan = bool(np.isnan(by_feature).any())
        for _ in range(self.depth):
            seen = by_feature[offset[node] + row]
            pick = 3 * node + (seen > self.value[node])  # NaN compares False: left ...
            if has_nan:
                pick += 2 * np.isnan(seen)  # ... unless missing
            node = children[pick]
        return self._sum(self.value[node].reshape(trees, rows))

    def _sum(self, leaves: FloatArray) -> FloatArray:
        """The baseline plus each tree's row of `leaves` (tree, row), tree by tree."""
        out = np.zeros(leaves.shape[1]) + self.baseline
        for tree in range(leaves.shape[0]):
            out += leaves[tree]
        return out

    def _leaf_tables(self) -> tuple[int, npt.NDArray[np.intp], FloatArray,
                                    npt.NDArray[np.bool_], FloatArray] | None:
        """What `predict` reads the trees through, or None for trees it walks instead:
        k, the most splits of any tree, and per (tree, split slot) the split's feature,
        threshold and whether missing values go right (a tree with fewer splits fills its
        slots with a test no row passes), and per (tree, code) the leaf value a row
        reaches whose outcome at slot j (right: 1) is bit j of the code. Made at each
        call (tens of microseconds), not kept: a controller keeps trees for every model
        of its fleet, and the table would double what they take."""
        nodes = np.arange(self.feature.size, dtype=np.intp)
        left, right = self.left.astype(np.intp), self.right.astype(np.intp)
        split_nodes = np.flatnonzero(left != nodes)
        tree_of = np.searchsorted(self.roots, nodes, side="right") - 1
        per_tree = np.bincount(tree_of[split_nodes], minlength=self.roots.size)
        splits = int(per_tree.max()) if split_nodes.size else 0
        missing = self.missing.astype(np.intp)[split_nodes]
        if (not 0 < splits <= TABLE_MAX_SPLITS
                or not np.all((missing == left[split_nodes]) | (missing == right[split_nodes]))
                or np.any(np.diff(self.roots) <= 0)):
            return None
        first = np.cumsum(per_tree) - per_tree  # each tree's first split in `split_nodes`
        slot_in_tree = np.zeros(nodes.size, dtype=np.intp)
        slot_in_tree[split_nodes] = (np.arange(split_nodes.size)
                                     - first[tree_of[split_nodes]])
        slot = tree_of[split_nodes] * splits + slot_in_tree[split_nodes]
        slots = self.roots.size * splits
        feature = np.zeros(slots, dtype=np.intp)
        feature[slot] = self.feature[split_nodes]
        value = np.full(slots, np.inf)  # an empty slot: no row goes right
        value[slot] = self.value[split_nodes]
        missing_right = np.zeros(slots, dtype=np.bool_)
        missing_right[slot] = (missing == right[split_nodes]) & (missing != left[split_nodes])
        codes = np.arange(1 << splits, dtype=np.intp)
        node = np.repeat(self.roots.astype(np.intp), codes.size).reshape(-1, codes.size)
        for _ in range(self.depth):
            node = np.where((codes >> slot_in_tree[node]) & 1 == 1, right[node], left[node])
        return splits, feature, value, missing_right, self.value[node]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.roots, self.feature, self.value, self.left,
                                      self.right, self.missing))


_threadpools: list[ThreadpoolController] = []  # the one controller (a scan of the loaded libraries)


def _one_openmp_thread() -> Any:
    """A context limiting OpenMP to one thread. The libraries are found once (scikit-learn's
    are loaded with the first fit): scanning them costs more than a small fit."""
    if not _threadpools:
        from threadpoolctl import ThreadpoolController

        _threadpools.append(ThreadpoolController())
    return _threadpools[0].limit(limits=1, user_api="openmp")


def fit_trees(x_train: FloatArray, y_train: FloatArray, quantile: float) -> FlatTrees:
    """The `quantile` model of y on x (scikit-learn's quantile gradient boosting), flat.
    Grown in numpy (`policies.quantile_trees`, the estimator's trees bit for bit);
    scikit-learn's estimator only for inputs that implementation does not cover."""
    from gearshift.policies.quantile_trees import fit_quantile_trees

    trees = fit_quantile_trees(x_train, y_train, quantile, rounds=FIT_ROUNDS,
                               learning_rate=FIT_LEARNING_RATE, max_leaves=FIT_LEAVES,
                               min_samples_leaf=FIT_MIN_SAMPLES_LEAF)
    return trees if trees is not None else fit_trees_sklearn(x_train, y_train, quantile)


def fit_trees_sklearn(x_train: FloatArray, y_train: FloatArray, quantile: float) -> FlatTrees:
    """`fit_trees` by scikit-learn's estimator (the reference the tests compare with)."""
    # scikit-learn (and SciPy's statistics with it) only here, not at import: seconds of
    # start-up and a hundred MB that the numpy trees do without.
    from gearshift.policies.quantile_gbm import flat_trees, quantile_regressor

    model = quantile_regressor(quantile=quantile, max_iter=FIT_ROUNDS,
                               learning_rate=FIT_LEARNING_RATE, max_leaf_nodes=FIT_LEAVES,
                               min_samples_leaf=FIT_MIN_SAMPLES_LEAF, early_stopping=False,
                               random_state=0)
    # One thread: the fits are small, and OpenMP threads contending on a busy host
    # (the controller, a backtest) make them several times slower.
    with _one_openmp_thread():
        model.fit(x_train, y_train)
    return flat_trees(model)


@dataclass(frozen=True, slots=True)
class ModelKey:
    """What a kept model is valid for: the same key, the same features and targets."""

    horizon_s: float
    bin_s: float
    quantile: float
    peak_quantile: float


class SeasonalModel:
    """The fitted low and peak models of one seasonal forecast, with what they were
    fitted on. The peak model may be deferred: fitted from the kept training rows when
    first asked for (the training rows go with that fit)."""

    __slots__ = ("_fit_peak", "_peak", "columns", "fitted_at", "key", "low", "train_rows")

    def __init__(self, key: ModelKey, fitted_at: float, train_rows: int,
                 columns: npt.NDArray[np.bool_], low: FlatTrees,
                 peak: FlatTrees | Callable[[], FlatTrees]) -> None:
        self.key, self.fitted_at, self.train_rows = key, fitted_at, train_rows
        self.columns, self.low = columns, low
        self._peak: FlatTrees | None = None
        self._fit_peak: Callable[[], FlatTrees] | None = None
        if isinstance(peak, FlatTrees):
            self._peak = peak
        else:
            self._fit_peak = peak

    @classmethod
    def fit(cls, key: ModelKey, fitted_at: float, columns: npt.NDArray[np.bool_],
            x_train: FloatArray, y_train: FloatArray, *, defer_peak: bool) -> SeasonalModel:
        """Fit the low model now, the peak model now or (`defer_peak`) when first used."""
        def peak() -> FlatTrees:
            return fit_trees(x_train, y_train, key.peak_quantile)

        return cls(key, fitted_at, int(y_train.size), columns,
                   fit_trees(x_train, y_train, key.quantile), peak if defer_peak else peak())

    def peak(self) -> FlatTrees:
        if self._peak is None:
            assert self._fit_peak is not None
            self._peak, self._fit_peak = self._fit_peak(), None
        return self._peak

    def due(self, key: ModelKey, now: float, train_rows: int) -> bool:
        """Whether a forecast at `now` with `train_rows` training rows must refit."""
        return (key != self.key or not 0.0 <= now - self.fitted_at < MODEL_REFIT_S
                or train_rows >= MODEL_REFIT_GROWTH * self.train_rows)

    def drifted(self, x_recent: FloatArray, y_recent: FloatArray) -> bool:
        """Whether the low model no longer fits the latest known targets: the share of
        them below its prediction strays from its quantile by more than DRIFT_TOLERANCE
        (a trend that stopped, a level shift the ratios did not foresee)."""
        if not y_recent.size:
            return False
        below = float(np.mean(y_recent < self.low.predict(x_recent[:, self.columns])))
        return abs(below - self.key.quantile) > DRIFT_TOLERANCE

    @property
    def nbytes(self) -> int:
        """Bytes of the trees' arrays (the peak's once fitted)."""
        return self.low.nbytes + (self._peak.nbytes if self._peak is not None else 0)
