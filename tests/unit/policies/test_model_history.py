"""`ModelHistory.replica_means` counts several windows and capacities in one pass (none
per sample where a window's lowest and highest rates need as many replicas): every mean
is the one a window counted alone gives (`costmodel.replicas` on each sample), to the
last bit, whether the rates are stored as float64 or float32, and asked once or again."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gearshift.policies.costmodel import replicas
from gearshift.policies.model_history import ModelHistory, count_replica_means

STEP_S = 300.0


def _alone(rates: list[float], capacity: float, headroom: float, min_replicas: int, n: int,
           scale: float) -> float:
    """One window's mean, sample by sample, by the cost model's own formula."""
    counts = [replicas(r * scale if scale != 1.0 else r, capacity, headroom, min_replicas)
              for r in rates[len(rates) - n:]]
    return float(sum(counts)) / n


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 400),
       capacities=st.lists(st.floats(0.05, 50.0), min_size=1, max_size=3),
       headroom=st.sampled_from([0.0, 0.2, 0.35]), min_replicas=st.integers(0, 3),
       windows=st.lists(st.tuples(st.integers(1, 400), st.sampled_from([1.0, 1.0, 0.7, 1.3])),
                        min_size=1, max_size=4),
       float32=st.booleans(), replay=st.booleans(), level=st.sampled_from([1e-3, 0.1, 1.0, 10.0]))
def test_one_pass_gives_every_window_alone(seed: int, steps: int, capacities: list[float],
                                           headroom: float, min_replicas: int,
                                           windows: list[tuple[int, float]], float32: bool,
                                           replay: bool, level: float) -> None:
    rng = np.random.default_rng(seed)
    rps = level * rng.lognormal(1.0, rng.choice([0.05, 1.5]), steps)
    # Rates on replica boundaries too (the epsilon's case): r * (1 + h) / c a whole number.
    rps[::7] = capacities[0] * rng.integers(1, 6, rps[::7].size) / (1 + headroom)
    if float32:
        rps = rps.astype(np.float32)
    ts = 1.8e9 + STEP_S * np.arange(steps)
    history = (ModelHistory.of(ts, rps, [], STEP_S, replay=True) if replay
               else ModelHistory(ts, rps, np.empty(0), STEP_S))
    first = int(rng.integers(1, steps + 1))
    # Asked again at the same end (the range it keeps), then at another, then the first.
    for end in (first, first, int(rng.integers(1, steps + 1)), first):
        mine = [(min(n, end), scale) for n, scale in windows]
        stored = [float(r) for r in rps[:end]]  # each stored rate, as a float64
        got = history.replica_means(end, capacities, headroom, min_replicas, mine)
        assert got == [[_alone(stored, c, headroom, min_replicas, n, scale) for n, scale in mine]
                       for c in capacities]


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 400), width=st.integers(1, 60),
       quantile=st.sampled_from([0.0, 0.05, 0.1, 0.5, 0.75, 0.9, 0.999, 1.0]),
       ties=st.booleans(), float32=st.booleans())
def test_rolling_is_numpy_on_every_window(seed: int, steps: int, width: int, quantile: float,
                                          ties: bool, float32: bool) -> None:
    """A replay's rolling max and quantile (kept from one sorted window moved sample by
    sample) are numpy's over each window, to the last bit, ties and idle steps included."""
    rng = np.random.default_rng(seed)
    rps = rng.lognormal(1.0, 1.0, steps)
    if ties:
        rps = np.round(rps) * (rng.random(steps) < 0.7)
    if float32:
        rps = rps.astype(np.float32)
    width = min(width, steps)
    history = ModelHistory.of(1.8e9 + STEP_S * np.arange(steps), rps, [], STEP_S, replay=True)
    peaks, quantiles = history.rolling(width, quantile)
    windows = np.lib.stride_tricks.sliding_window_view(rps.astype(np.float64), width)
    assert np.array_equal(peaks, windows.max(axis=1))
    assert np.array_equal(quantiles, np.quantile(windows, quantile, axis=1))


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 300), models=st.integers(1, 6),
       engines=st.lists(st.integers(1, 3), min_size=6, max_size=6),
       headroom=st.sampled_from([0.0, 0.2, 0.35]), min_replicas=st.integers(0, 3),
       float32=st.booleans(), replay=st.booleans(), level=st.sampled_from([1e-3, 1.0, 10.0]))
def test_fleet_pass_gives_each_model_alone(seed: int, steps: int, models: int,
                                           engines: list[int], headroom: float,
                                           min_replicas: int, float32: bool, replay: bool,
                                           level: float) -> None:
    """Scaled windows of many models counted in one pass (`count_replica_means`) and handed
    over: each model then reads, to the last bit, what it counts alone, at that `end`; at
    another `end` it counts again."""
    rng = np.random.default_rng(seed)
    asks, alone = [], []
    for m in range(models):
        rps = level * rng.lognormal(1.0, rng.choice([0.05, 1.5]), steps)
        capacities = [float(c) for c in rng.uniform(0.05, 50.0, engines[m])]
        rps[::5] = capacities[0] * rng.integers(1, 6, rps[::5].size) / (1 + headroom)
        if float32:
            rps = rps.astype(np.float32)
        ts = 1.8e9 + STEP_S * np.arange(steps)
        history = (ModelHistory.of(ts, rps, [], STEP_S, replay=True) if replay
                   else ModelHistory(ts, rps, np.empty(0), STEP_S))
        twin = ModelHistory.of(ts, rps, [], STEP_S, replay=replay)  # never handed anything
        end = int(rng.integers(1, steps + 1))
        n = int(rng.integers(1, end + 1)) if m % 2 else end  # some models share a length
        scale = float(rng.choice([0.7, 1.3, 2.0]))
        windows = [(n, scale), (end, 1.0)]
        asks.append((history, end, capacities, headroom, min_replicas, windows))
        alone.append((history, twin, end, capacities, windows))
    count_replica_means(asks)
    for history, twin, end, capacities, windows in alone:
        stored = [float(r) for r in history.rps[:end]]
        want = [[_alone(stored, c, headroom, min_replicas, w, s) for w, s in windows]
                for c in capacities]
        assert history.replica_means(end, capacities, headroom, min_replicas, windows) == want
        assert twin.replica_means(end, capacities, headroom, min_replicas, windows) == want
        if end > 1:  # what was handed over at `end` is not read at another
            other = [(min(n, end - 1), s) for n, s in windows]
            assert (history.replica_means(end - 1, capacities, headroom, min_replicas, other)
                    == twin.replica_means(end - 1, capacities, headroom, min_replicas, other))



def test_the_replica_prefix_sums_of_many_capacities_are_kept_bounded_and_made_again_alike(
) -> None:
    """A blind backtest learns a new capacity hundreds of times a run: a history keeps the
    prefix sums of the last `PREFIXES_KEPT` capacities used (the same array when asked
    again), and one asked for again after it went is made again, the same to the bit: the
    cost model's replicas of each sample, summed."""
    from gearshift.policies.model_history import PREFIXES_KEPT

    rng = np.random.default_rng(7)
    rps = rng.lognormal(1.0, 1.0, 500)
    history = ModelHistory.of(np.arange(500) * STEP_S, rps, [], STEP_S, replay=True)
    first = history.prefix_replicas(0.5, 0.2, 1)
    assert history.prefix_replicas(0.5, 0.2, 1) is first  # kept
    others = [history.prefix_replicas(1.0 + i, 0.2, 1) for i in range(PREFIXES_KEPT - 1)]
    assert history.prefix_replicas(0.5, 0.2, 1) is first  # still among the last used
    # as many others again: 0.5 was read last before them, and goes
    more = [history.prefix_replicas(100.0 + i, 0.2, 1) for i in range(PREFIXES_KEPT)]
    again = history.prefix_replicas(0.5, 0.2, 1)
    assert again is not first
    np.testing.assert_array_equal(again, first)
    assert history.prefix_replicas(100.0 + PREFIXES_KEPT - 1, 0.2, 1) is more[-1]
    assert history.prefix_replicas(1.0, 0.2, 1) is not others[0]  # went long ago
    for capacity, made in ((0.5, again), (1.0, others[0]), (100.0, more[0])):
        counts = np.cumsum([replicas(float(r), capacity, 0.2, 1) for r in rps])
        np.testing.assert_array_equal(made[1:], counts)
        assert made[0] == 0.0
