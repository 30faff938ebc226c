"""The rate history keeps the newest samples of each model, oldest first, one per
resolution step, within its retention."""

from __future__ import annotations

from collections import deque

from hypothesis import given
from hypothesis import strategies as st

from gearshift.controller.rate_history import RateHistory


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
            expected.append((t, rps))
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
        expected.extend(zip(times, chunk, strict=True))
        bulk.sample(t, {"m": -1.0})
        expected.append((t, -1.0))
        t += 1
    ts, rps_out = bulk.arrays("m")
    assert list(zip(ts.tolist(), rps_out.tolist(), strict=True)) == list(expected)
