"""The rate history keeps the newest samples of each model, oldest first, one per
resolution step, within its retention; each rate as a float32 (`stored`)."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gearshift.controller.ingest.rate_history import RateHistory


def stored(rps: float) -> float:
    """A rate as the history keeps it: the nearest float32."""
    return float(np.float32(rps))


@given(steps=st.lists(st.tuples(st.floats(0.0, 30.0), st.floats(0.0, 1e4)), max_size=400),
       retention=st.integers(10, 120))
def test_keeps_the_newest_samples_in_order(steps: list[tuple[float, float]], retention: int) -> None:
    """Against the plain definition: a bounded queue of (time, rate), a sample under half
    a step after the last one skipped."""
    history = RateHistory(1.0, retention_s=retention)
    expected: deque[tuple[float, float]] = deque(maxlen=retention)
    t = 1000.0
    for gap, rps in steps:
        t += gap
        history.sample(t, {"m": rps})
        if not expected or t - expected[-1][0] >= 0.5:
            expected.append((t, stored(rps)))
    ts, rps_out = history.arrays("m")
    assert list(zip(ts.tolist(), rps_out.tolist(), strict=True)) == list(expected)
    assert history.models() == (["m"] if steps else [])


def test_models_are_kept_apart_and_unknown_ones_are_empty() -> None:
    history = RateHistory(60.0)
    for k in range(5):
        history.sample(60.0 * k, {"a": float(k), "b": 10.0 * k})
    assert history.arrays("a")[1].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert history.arrays("b")[1].tolist() == [0.0, 10.0, 20.0, 30.0, 40.0]
    assert history.arrays("c")[0].size == 0


@given(chunks=st.lists(st.lists(st.floats(0.0, 1e4), max_size=60), max_size=6),
       retention=st.integers(10, 120))
def test_extend_is_sample_by_sample_appending(chunks: list[list[float]], retention: int) -> None:
    """Bulk appends (seeding, a fleet loaded at once) keep what appending each sample
    would, across the ring's growth and wrap-around, and later samples still go after them."""
    bulk = RateHistory(1.0, retention_s=retention)
    expected: deque[tuple[float, float]] = deque(maxlen=retention)
    t = 0.0
    for chunk in chunks:
        times = [t + i for i in range(len(chunk))]
        t += len(chunk)
        bulk.extend("m", times, chunk)
        expected.extend(zip(times, map(stored, chunk), strict=True))
        bulk.sample(t, {"m": -1.0})
        expected.append((t, -1.0))
        t += 1
    ts, rps_out = bulk.arrays("m")
    assert list(zip(ts.tolist(), rps_out.tolist(), strict=True)) == list(expected)


@given(steps=st.lists(st.tuples(st.floats(0.0, 30.0), st.sets(st.sampled_from("abc"), max_size=3)),
                      max_size=200),
       retention=st.integers(10, 60))
def test_models_share_the_sample_times(steps: list[tuple[float, set[str]]], retention: int) -> None:
    """Models sampled together keep their own samples (none where they were missing), of
    the newest `retention` sample times of the fleet."""
    history = RateHistory(1.0, retention_s=retention)
    times: list[float] = []
    kept: dict[str, list[tuple[float, float]]] = {}
    t = 1000.0
    for k, (gap, present) in enumerate(steps):
        t += gap
        rates = {m: float(k) for m in sorted(present)}
        history.sample(t, rates)
        taken = {m for m in rates if not kept.get(m) or t - kept[m][-1][0] >= 0.5}
        if taken and (not times or t > times[-1]):
            times.append(t)
        for m in taken:
            kept.setdefault(m, []).append((t, float(k)))
    window = set(times[-retention:])
    for m in "abc":
        ts, rps = history.arrays(m)
        assert list(zip(ts.tolist(), rps.tolist(), strict=True)) == [
            (at, r) for at, r in kept.get(m, []) if at in window]
    assert history.models() == sorted(kept)


def test_extending_models_with_different_times_merges_the_axis() -> None:
    """Seeding models whose minutes differ: each keeps its samples, later ones append."""
    history = RateHistory(60.0, retention_s=600.0)  # ten sample times
    history.extend_many({"a": ([60.0, 180.0, 300.0], [1.0, 3.0, 5.0]),
                         "b": ([120.0, 180.0], [2.0, 3.5])})
    history.extend("c", [0.0, 240.0], [9.0, 4.0])
    history.sample(360.0, {"a": 6.0, "c": 6.5})
    assert history.arrays("a")[1].tolist() == [1.0, 3.0, 5.0, 6.0]
    assert history.arrays("b")[0].tolist() == [120.0, 180.0]
    assert history.arrays("c")[0].tolist() == [0.0, 240.0, 360.0]
    assert history.axis().tolist() == [0.0, 60.0, 120.0, 180.0, 240.0, 300.0, 360.0]
    for k in range(7, 12):  # past the retention, the oldest times go
        history.sample(60.0 * k, {"b": float(k)})
    assert history.axis().size == 10 and history.axis()[0] == 120.0
    assert history.arrays("b")[1].tolist() == [2.0, 3.5, 7.0, 8.0, 9.0, 10.0, 11.0]
    assert history.arrays("c")[0].tolist() == [240.0, 360.0]


def test_mismatched_lengths_are_refused_and_change_nothing() -> None:
    history = RateHistory(60.0)
    history.extend("a", [60.0], [1.0])
    with pytest.raises(ValueError, match="b: 2 sample times but 1 rates"):
        history.extend_many({"a": ([120.0], [2.0]), "b": ([60.0, 120.0], [1.0])})
    assert history.arrays("a")[1].tolist() == [1.0] and history.models() == ["a"]


@given(rates=st.lists(st.floats(0.0, 1e6), min_size=1, max_size=50))
def test_a_rate_is_kept_within_a_float32_of_what_was_reported(rates: list[float]) -> None:
    """Relative error at most 2**-24 (the float32's rounding; absolute 2**-150 rps for the
    rates under float32's range, 1e-38), read back as float64."""
    history = RateHistory(1.0, retention_s=100)
    history.extend("m", [float(i) for i in range(len(rates))], rates)
    got = history.arrays("m")[1]
    assert got.dtype == np.float64
    for reported, kept in zip(rates, got.tolist(), strict=True):
        assert abs(kept - reported) <= max(2.0**-24 * reported, 2.0**-150)
