"""Quantile gradient boosting grown in numpy: scikit-learn's trees without scikit-learn.

The seasonal forecast fits `HistGradientBoostingRegressor(loss="quantile")` with a
fixed, small configuration (`forecast_model.FIT_*`: 20 rounds of 7-leaf trees, no
regularisation, no early stopping, no sample weights, no categorical features).
Importing scikit-learn (and SciPy's statistics with it) costs about a second of
CPU and 100 MB, more than the dozens of fits a forecast worker or a blind backtest
makes after it, and each of its fits costs more than these (measured on the
generated fleet's 151 fits: 12 ms of CPU a fit here, 20 ms by the estimator; the
fleet's blind backtest 12-15 s of CPU here, 19 s fitting with the estimator, the
same decisions); `fit_quantile_trees` grows the same trees with numpy alone, bit for bit,
by taking every step the estimator takes in the same order and the same
precision:

- binning: per feature, the midpoints of the distinct values (at most 255 of
  them) or numpy's "averaged_inverted_cdf" percentiles, de-duplicated; a value
  goes to the first bin whose threshold is >= it, NaN to bin 255;
- the baseline and every leaf: `percentile_linear` of the targets, then of each
  leaf's residuals (times the learning rate);
- gradients: -q where the target is >= the raw prediction, else 1 - q, computed in
  double and stored as float32; hessians constant (1, so a node's hessian sum is
  its sample count);
- histograms: per (feature, bin), gradients summed in sample order in double
  (`np.bincount` adds in index order); the smaller child's built from its samples,
  the larger one as the parent's minus it (a tie builds the right child);
- splits: left-to-right cumulative sums (missing values to the right), then for a
  feature with missing values right-to-left (missing to the left), the gain as
  loss(node) - g_l * v_l - g_r * v_r with v = -g / (h + 1e-15); the first best bin,
  the first best feature, a strictly better right-to-left scan replacing it;
- best-first growth with the estimator's heap order until 7 leaves; a child with
  fewer than 2 x min_samples_leaf samples is a leaf; a split on a feature without
  missing values sends NaN to the larger child.

Inputs outside that ground (a NaN target, a column that is constant apart from
NaN, more rows than the estimator's binning subsample) return None and the caller
uses scikit-learn's estimator. Tests (`tests/unit/policies/test_quantile_trees.py`)
compare every array of the `FlatTrees` with the estimator's over random and
forecast-shaped data; `make test-sklearn` runs them on each scikit-learn release that
pyproject.toml allows (from 1.9: earlier releases bin a column of over 255 distinct
values at "midpoint" percentiles, and grow other trees).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

from gearshift.policies.forecast_features import FloatArray
from gearshift.policies.forecast_model import FlatTrees

MAX_BINS = 255            # the estimator's default: bins for values; bin 255 holds NaN
MISSING_BIN = MAX_BINS
BINNING_SUBSAMPLE = 200_000  # above this many rows the estimator bins a random subsample
ALMOST_INF = 1e300        # the estimator's cap on thresholds
MIN_HESSIAN_TO_SPLIT = 1e-3
VALUE_EPS = 1e-15         # in a node's value -g / (h + l2 + eps)
# The estimator's histogram record, so that the root's gradient sum is taken by the
# same numpy reduction over the same memory layout.
_HISTOGRAM = np.dtype([("sum_gradients", np.float64), ("sum_hessians", np.float64),
                       ("count", np.uint32)])


def percentile_linear(values: npt.NDArray[np.float64], quantile: float) -> float:
    """`np.percentile(values, 100 * quantile)` (method "linear") of a 1-d array without
    NaN, bit for bit. Reorders `values` in place (as numpy's partition would a copy)."""
    n = values.shape[0]
    q = np.true_divide(np.float64(100 * quantile), 100)
    virtual = (n - 1) * q
    below = int(np.floor(virtual))
    lo = min(max(below, 0), n - 1)
    hi = min(lo + 1, n - 1) if virtual >= 0 else 0
    values.partition((lo, hi) if hi != lo else lo)
    a, b = values[lo], values[hi]
    gamma = virtual - np.float64(below)
    diff = b - a
    # numpy's lerp: from the nearer end, so that gamma = 1 gives b exactly.
    return float(b - diff * (1 - gamma)) if gamma >= 0.5 else float(a + diff * gamma)


def bin_thresholds(column: FloatArray) -> FloatArray:
    """The estimator's bin thresholds of one feature (NaN ignored)."""
    values = column[~np.isnan(column)]
    values = values[np.argsort(values)]
    distinct = np.unique(values).astype(np.float64)
    if distinct.size <= 1:
        return np.asarray([], dtype=np.float64)
    if distinct.size <= MAX_BINS:
        thresholds = sliding_window_view(distinct, 2).mean(axis=1)
    else:
        percentiles = np.linspace(0, 100, num=MAX_BINS + 1)[1:-1]
        thresholds = np.percentile(values, percentiles, method="averaged_inverted_cdf")
    unique = np.unique(thresholds)
    if unique.shape[0] != thresholds.shape[0]:
        thresholds = unique
    np.clip(thresholds, a_min=None, a_max=ALMOST_INF, out=thresholds)
    return np.asarray(thresholds, dtype=np.float64)


@dataclass(eq=False)
class _Split:
    gain: float
    feature: int
    bin: int
    missing_left: bool
    g_left: float
    h_left: float
    g_right: float
    h_right: float
    value_left: float
    value_right: float


@dataclass(eq=False)
class _Node:
    rows: npt.NDArray[np.intp]      # ascending sample indices
    depth: int
    g: float                        # gradient sum
    h: float                        # hessian sum (the sample count)
    value: float
    hist_g: FloatArray | None = None    # (features, 256) gradient sums
    hist_n: npt.NDArray[np.intp] | None = None  # (features, 256) counts
    split: _Split | None = None
    left: _Node | None = None
    right: _Node | None = None
    is_leaf: bool = False
    leaf_value: float = 0.0

    def __lt__(self, other: _Node) -> bool:  # the estimator's heap: higher gain first
        assert self.split is not None and other.split is not None
        return self.split.gain > other.split.gain


def _node_value(g: float, h: float) -> float:
    return -g / (h + 0.0 + VALUE_EPS)


@dataclass(frozen=True, eq=False)
class _Bins:
    """A fit's binned features, and what every tree's split search reads of them."""

    by_feature: npt.NDArray[np.intp]        # (features, rows), bins 0..255: a feature's
                                            # bins contiguous, for the splits' 1-D gathers
    flat: npt.NDArray[np.intp]              # feature f's bin b as f * 256 + b
    non_missing: npt.NDArray[np.int64]      # bins of values per feature
    has_missing: npt.NDArray[np.bool_]
    scan: npt.NDArray[np.bool_]             # (features, 256): the left-to-right scan's bins
    counts: npt.NDArray[np.intp]            # (features, 256): every row's, the roots' counts

    @classmethod
    def of(cls, binned: npt.NDArray[np.intp], non_missing: npt.NDArray[np.int64],
           has_missing: npt.NDArray[np.bool_]) -> _Bins:
        features = binned.shape[1]
        flat = binned + np.arange(features, dtype=np.intp) * (MAX_BINS + 1)
        # The estimator scans bins below non_missing - 1 + has_missing.
        scan = np.arange(MAX_BINS + 1)[None, :] < (non_missing - 1 + has_missing)[:, None]
        counts = np.bincount(flat.ravel(), minlength=features * (MAX_BINS + 1))
        return cls(np.ascontiguousarray(binned.T), flat, non_missing, has_missing, scan,
                   counts.reshape(features, MAX_BINS + 1))


class _Grower:
    """One tree, grown as the estimator's `TreeGrower` grows it."""

    def __init__(self, bins: _Bins, gradients: FloatArray, max_leaves: int,
                 min_samples_leaf: int) -> None:
        self.by_feature = bins.by_feature
        self.flat_bins = bins.flat
        self.features, self.rows = bins.by_feature.shape
        self.gradients = gradients  # each row's (a float32's value in double)
        self.non_missing_bins = bins.non_missing
        self.has_missing = bins.has_missing
        self.any_missing = bool(bins.has_missing.any())
        self.scan = bins.scan
        self.root_counts = bins.counts  # the same every round: counted once a fit
        self.max_leaves, self.min_samples_leaf = max_leaves, min_samples_leaf
        self.leaves: list[_Node] = []
        self.heap: list[_Node] = []

    def histograms(self, rows: npt.NDArray[np.intp] | None
                   ) -> tuple[FloatArray, npt.NDArray[np.intp]]:
        """Per (feature, bin) of the rows (all when None): gradient sums in sample order,
        and counts (the hessian sums: whole numbers, the same in double; kept as integers,
        whose cumulative sums cost a third of a double's). Neither is changed in place."""
        index = (self.flat_bins if rows is None else self.flat_bins[rows]).ravel()
        # A row's gradient once per feature, in the index's (row-major) order: gathered
        # one value a row, then repeated (a 2-D gather of every (row, feature) costs more).
        weights = (self.gradients if rows is None else self.gradients[rows]).repeat(self.features)
        shape = (self.features, MAX_BINS + 1)
        g = np.bincount(index, weights=weights, minlength=shape[0] * shape[1])
        if rows is None:
            return g.reshape(shape), self.root_counts
        n = np.bincount(index, minlength=shape[0] * shape[1])
        return g.reshape(shape), n.reshape(shape)

    def find_split(self, node: _Node) -> _Split | None:
        assert node.hist_g is not None and node.hist_n is not None
        m = self.min_samples_leaf
        loss = node.g * node.value
        g_left = node.hist_g.cumsum(axis=1)
        # Hessian sums are sample counts (exact in double), so the estimator's
        # min_hessian_to_split checks hold wherever both sides have min_samples_leaf
        # (>= 1) samples, and h + l2 (0) is h. Summed as integers: the same figures.
        h_left = node.hist_n.cumsum(axis=1)
        h_right = node.h - h_left
        g_right = node.g - g_left
        ok = self.scan & (h_left >= m) & (h_right >= m)
        gain = loss - g_left * (-g_left / (h_left + VALUE_EPS)) \
            - g_right * (-g_right / (h_right + VALUE_EPS))
        gain = np.where(ok, gain, -np.inf)
        if not self.any_missing:
            # The first maximum in (feature, bin) order: the estimator's first best bin
            # of its first best feature.
            f, b = divmod(int(gain.argmax()), MAX_BINS + 1)
            if not gain[f, b] > 0.0:
                return None
            return self._split(node, float(gain[f, b]), f, b, False, float(g_left[f, b]),
                               float(h_left[f, b]))
        best_bin = np.argmax(gain, axis=1)
        # Per feature: (gain, bin, missing to the left, g_left, h_left).
        found: list[tuple[float, int, bool, float, float]] = []
        for f in range(self.features):
            b = int(best_bin[f])
            if gain[f, b] > 0.0:
                best = (float(gain[f, b]), b, False, float(g_left[f, b]), float(h_left[f, b]))
            else:
                best = (-1.0, 0, False, 0.0, 0.0)
            if self.has_missing[f]:
                best = self._right_to_left(node, f, loss, best)
            found.append(best)
        pick = 0
        for f in range(1, self.features):
            if found[f][0] > found[pick][0]:
                pick = f
        gain_, b, missing_left, g_l, h_l = found[pick]
        if not gain_ > 0.0:
            return None
        return self._split(node, gain_, pick, b, missing_left, g_l, h_l)

    @staticmethod
    def _split(node: _Node, gain: float, f: int, b: int, missing_left: bool, g_left: float,
               h_left: float) -> _Split:
        g_right, h_right = node.g - g_left, node.h - h_left
        return _Split(gain, f, b, missing_left, g_left, h_left, g_right, h_right,
                      _node_value(g_left, h_left), _node_value(g_right, h_right))

    def _right_to_left(self, node: _Node, f: int, loss: float,
                       best: tuple[float, int, bool, float, float]
                       ) -> tuple[float, int, bool, float, float]:
        """The estimator's second scan of a feature with missing values (they go left)."""
        assert node.hist_g is not None and node.hist_n is not None
        top = int(self.non_missing_bins[f]) - 1           # highest non-missing bin
        if top < 1:
            return best
        m = self.min_samples_leaf
        # bin b (top - 1 down to 0): the right side holds bins b + 1 .. top.
        g_right = np.cumsum(node.hist_g[f, top:0:-1])
        h_right = np.cumsum(node.hist_n[f, top:0:-1])
        h_left = node.h - h_right
        g_left = node.g - g_right
        gain = loss - g_left * (-g_left / (h_left + VALUE_EPS)) \
            - g_right * (-g_right / (h_right + VALUE_EPS))
        ok = (h_right >= m) & (h_left >= m) & (gain > 0.0) & (gain > best[0])
        if not ok.any():
            return best
        i = int(np.argmax(np.where(ok, gain, -np.inf)))    # first in scan order
        return (float(gain[i]), top - 1 - i, True, float(g_left[i]), float(h_left[i]))

    def push(self, node: _Node) -> None:
        node.split = self.find_split(node)
        if node.split is None:
            self.finalize(node)
        else:
            heapq.heappush(self.heap, node)

    def finalize(self, node: _Node) -> None:
        node.is_leaf = True
        self.leaves.append(node)

    def grow(self) -> _Node:
        n = self.rows
        rows = np.arange(n, dtype=np.intp)
        hist_g, hist_n = self.histograms(None)
        # The root's gradient sum: the estimator's numpy sum over feature 0's histogram
        # records (pairwise, so not the sequential total).
        record = np.zeros(MAX_BINS + 1, dtype=_HISTOGRAM)
        record["sum_gradients"] = hist_g[0]
        root = _Node(rows, 0, float(record["sum_gradients"].sum()), float(n), 0.0)
        if n < 2 * self.min_samples_leaf:
            self.finalize(root)
            return root
        root.hist_g, root.hist_n = hist_g, hist_n
        self.push(root)
        while self.heap:
            self.split_next(heapq.heappop(self.heap))
        return root

    def split_next(self, node: _Node) -> None:
        split = node.split
        assert split is not None
        bins = self.by_feature[split.feature][node.rows]  # the feature's, a 1-D gather
        goes_left = bins <= split.bin
        if split.missing_left:
            goes_left |= bins == MISSING_BIN
        depth = node.depth + 1
        left = _Node(node.rows[goes_left], depth, split.g_left, split.h_left, split.value_left)
        right = _Node(node.rows[~goes_left], depth, split.g_right, split.h_right,
                      split.value_right)
        node.left, node.right = left, right
        if not self.has_missing[split.feature]:
            split.missing_left = left.rows.size > right.rows.size
        if len(self.leaves) + len(self.heap) + 2 == self.max_leaves:
            self.finalize(left)
            self.finalize(right)
            while self.heap:
                self.finalize(self.heap.pop())
            return
        for child in (left, right):
            if child.rows.size < 2 * self.min_samples_leaf:
                self.finalize(child)
        if left.is_leaf and right.is_leaf:
            return
        small, large = (left, right) if left.rows.size < right.rows.size else (right, left)
        assert node.hist_g is not None and node.hist_n is not None
        small.hist_g, small.hist_n = self.histograms(small.rows)
        large.hist_g, large.hist_n = node.hist_g - small.hist_g, node.hist_n - small.hist_n
        node.hist_g = node.hist_n = None
        for child in (left, right):
            if not child.is_leaf:
                self.push(child)
        for child in (left, right):
            if child.is_leaf:
                child.hist_g = child.hist_n = None


def fit_quantile_trees(x: FloatArray, y: FloatArray, quantile: float, *, rounds: int,
                       learning_rate: float, max_leaves: int,
                       min_samples_leaf: int) -> FlatTrees | None:
    """The estimator's quantile trees of y on x as `FlatTrees`, or None where this
    implementation does not follow the estimator (see the module docstring)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    rows, features = x.shape
    if (rows == 0 or rows > BINNING_SUBSAMPLE or y.shape != (rows,) or features == 0
            or np.isnan(y).any() or features > 127):
        return None
    thresholds = [bin_thresholds(x[:, f]) for f in range(features)]
    missing = np.isnan(x)
    has_missing = missing.any(axis=0)
    non_missing_bins = np.array([t.size + 1 for t in thresholds], dtype=np.int64)
    if np.any(has_missing & (non_missing_bins < 2)):
        return None  # a column constant apart from NaN: the estimator's scan wraps around
    binned = np.empty((rows, features), dtype=np.intp)
    for f in range(features):
        binned[:, f] = np.searchsorted(thresholds[f], x[:, f], side="left")
    binned[missing] = MISSING_BIN

    bins = _Bins.of(binned, non_missing_bins, has_missing)
    baseline = percentile_linear(y.copy(), quantile)
    raw = np.zeros(rows) + np.float64(baseline)
    minus_q, one_minus_q = -quantile, 1.0 - quantile
    trees: list[_Node] = []
    for _ in range(rounds):
        gradients = np.where(y >= raw, minus_q, one_minus_q).astype(np.float32)
        grower = _Grower(bins, gradients.astype(np.float64), max_leaves, min_samples_leaf)
        root = grower.grow()
        for leaf in grower.leaves:
            residuals = y[leaf.rows] - raw[leaf.rows]
            leaf.leaf_value = float(learning_rate * np.float64(
                percentile_linear(residuals, quantile)))
        for leaf in grower.leaves:
            raw[leaf.rows] += leaf.leaf_value
        trees.append(root)
    return _flatten(baseline, trees, thresholds, non_missing_bins)


def _flatten(baseline: float, trees: list[_Node], thresholds: list[FloatArray],
             non_missing_bins: npt.NDArray[np.int64]) -> FlatTrees:
    """The trees in the estimator's predictor order (each node, its left subtree, then
    its right subtree), as `FlatTrees`."""
    feature: list[int] = []
    value: list[float] = []
    left: list[int] = []
    right: list[int] = []
    missing: list[int] = []
    roots: list[int] = []
    depth = 0

    def add(node: _Node) -> int:
        nonlocal depth
        i = len(feature)
        depth = max(depth, node.depth)
        feature.append(0)
        value.append(0.0)
        left.append(i)
        right.append(i)
        missing.append(i)
        if node.is_leaf:
            value[i] = node.leaf_value
            return i
        split = node.split
        assert split is not None and node.left is not None and node.right is not None
        feature[i] = split.feature
        value[i] = (np.inf if split.bin == non_missing_bins[split.feature] - 1
                    else float(thresholds[split.feature][split.bin]))
        left[i] = add(node.left)
        right[i] = add(node.right)
        missing[i] = left[i] if split.missing_left else right[i]
        return i

    for tree in trees:
        roots.append(add(tree))
    if len(feature) > np.iinfo(np.int16).max:
        raise ValueError(f"{len(feature)} nodes do not fit FlatTrees' int16 indices")
    return FlatTrees(baseline=float(baseline), roots=np.array(roots, dtype=np.intp),
                     feature=np.array(feature, dtype=np.int8),
                     value=np.array(value, dtype=np.float64),
                     left=np.array(left, dtype=np.int16), right=np.array(right, dtype=np.int16),
                     missing=np.array(missing, dtype=np.int16), depth=depth)
