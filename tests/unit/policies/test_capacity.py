"""Capacity model: monotone fit, SLA crossing, bounds, bad data, persistence, gain, plot."""

from __future__ import annotations

import itertools
import json
import math
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gearshift.common.errors import InvalidArgument
from gearshift.policies.capacity import (
    MAX_BINS,
    CapacityEstimate,
    CapacityKey,
    CapacityModel,
    LoadObservation,
    gain,
    plot_capacity,
)
from gearshift.policies.capacity_fit import (
    BIN_RATIO,
    OUTLIER_FACTOR,
    estimate_metric,
    monotone_fit,
    outlier_mask,
)

SLA_S = 0.45


def p99_at(load: float, capacity: float) -> float:
    """A queueing-like curve: 0.05 s idle, SLA_S reached at 95% of `capacity`."""
    if load >= capacity:
        return 5.0
    return 0.05 + 0.02 / (1.0 - load / capacity)


def crossing(capacity: float) -> float:
    return capacity * (1.0 - 0.02 / (SLA_S - 0.05))


def synthetic(n: int, capacity: float = 50.0, *, top: float = 60.0, seed: int = 0,
              engine: str = "vllm", **overrides: Any) -> CapacityModel:
    rng = np.random.default_rng(seed)
    model = CapacityModel(CapacityKey("llama", engine, "1.0", "H100"), **overrides)
    for i in range(n):
        load = float(rng.uniform(2.0, top))
        served = min(load, capacity)   # the finished-request rate saturates
        model.add(LoadObservation(float(i), served, p99_at(load, capacity)
                                  * float(rng.lognormal(0, 0.1)), 0.02))
    return model


def test_monotone_fit_recovers_the_sla_crossing() -> None:
    est = synthetic(400).estimate(sla_ttft_p99_s=SLA_S)
    assert est.status == "ok"
    assert est.capacity_rps == pytest.approx(crossing(50.0), rel=0.04)
    assert est.low is not None and est.high is not None
    assert est.low <= est.capacity_rps <= est.high
    assert est.limited_by == "ttft"
    fitted = [p.fitted_p99_s for p in synthetic(400).curve("ttft")]
    assert fitted == sorted(fitted)


def test_band_narrows_with_more_data() -> None:
    few = synthetic(40, seed=1).estimate(sla_ttft_p99_s=SLA_S)
    many = synthetic(800, seed=1).estimate(sla_ttft_p99_s=SLA_S)
    assert few.status == many.status == "ok"
    assert few.low is not None and few.high is not None
    assert many.low is not None and many.high is not None
    assert (many.high - many.low) < (few.high - few.low)


def test_never_reaching_the_sla_is_a_lower_bound() -> None:
    est = synthetic(100, top=30.0).estimate(sla_ttft_p99_s=SLA_S)
    assert est.status == "lower_bound"
    assert est.capacity_rps == pytest.approx(est.max_observed_rps, rel=0.05)
    assert "at least" in est.reason


def test_above_the_sla_everywhere_is_an_upper_bound() -> None:
    est = synthetic(100).estimate(sla_ttft_p99_s=0.01)
    assert est.status == "upper_bound"
    assert "at most" in est.reason


def test_the_binding_metric_is_the_lower_capacity() -> None:
    model = CapacityModel(CapacityKey("m", "vllm", "1", "H100"))
    for i, load in enumerate(np.linspace(1, 40, 60)):
        model.add(LoadObservation(float(i), float(load), 0.1, 0.01 + 0.001 * float(load)))
    est = model.estimate(sla_ttft_p99_s=1.0, sla_itl_p99_s=0.03)
    assert est.status == "ok" and est.limited_by == "itl"
    assert est.capacity_rps == pytest.approx(20.0, rel=0.06)


@pytest.mark.parametrize(("rows", "expected"), [
    ([(float("nan"), 0.1)], "load NaN"),
    ([(-1.0, 0.1)], "load NaN"),
    ([(5.0, float("nan"))], "latency NaN"),
    ([(5.0, -0.2)], "latency NaN"),
    ([(0.0, 0.1)], "idle"),
    ([(5.0, None)], "no latency"),
])
def test_bad_observations_are_refused_with_a_reason(rows: list[tuple[float, float | None]],
                                                    expected: str) -> None:
    model = CapacityModel(CapacityKey("m", "vllm", "1", "H100"))
    for load, ttft in rows:
        reason = model.add(LoadObservation(0.0, load, ttft, None))
        assert reason is not None and expected in reason
    assert len(model) == 0 and sum(model.rejected.values()) == len(rows)
    est = model.estimate(sla_ttft_p99_s=SLA_S)
    assert est.status == "insufficient_data" and "0 observation" in est.reason


def test_too_few_points_and_a_constant_load_are_insufficient() -> None:
    few = synthetic(5).estimate(sla_ttft_p99_s=SLA_S)
    assert few.status == "insufficient_data" and "need" in few.reason
    constant = CapacityModel(CapacityKey("m", "vllm", "1", "H100"))
    for i in range(50):
        constant.add(LoadObservation(float(i), 10.0, 0.2 + 0.01 * (i % 3), None))
    est = constant.estimate(sla_ttft_p99_s=SLA_S)
    assert est.status == "insufficient_data" and "too narrow" in est.reason
    assert est.capacity_rps is None


def test_outliers_are_ignored_and_mostly_outliers_is_insufficient() -> None:
    model = synthetic(300)
    for i in range(10):   # a few minutes with absurd p99 at low load (GC pause, restart)
        model.add(LoadObservation(1000.0 + i, 5.0 + i, 60.0, None))
    est = model.estimate(sla_ttft_p99_s=SLA_S)
    assert est.status == "ok"
    assert est.capacity_rps == pytest.approx(crossing(50.0), rel=0.05)
    assert "outlier" in est.reason
    garbage = CapacityModel(CapacityKey("m", "vllm", "1", "H100"))
    rng = np.random.default_rng(3)
    for i in range(60):
        garbage.add(LoadObservation(float(i), float(rng.uniform(1, 50)),
                                    float(rng.choice([0.05, 50.0])), None))
    bad = garbage.estimate(sla_ttft_p99_s=SLA_S)
    assert bad.status == "insufficient_data" and ("outlier" in bad.reason or "noisy" in bad.reason)


def test_memory_is_bounded_per_load_bin() -> None:
    model = CapacityModel(CapacityKey("m", "vllm", "1", "H100"), per_bin=8)
    for i in range(5000):
        model.add(LoadObservation(float(i), 10.0 + (i % 2) * 0.01, 0.1, None))
    assert len(model) <= 16
    assert model.accepted == 5000
    assert max(o.ts for o in model.observations()) == 4999.0


def test_persistence_round_trip_gives_the_same_estimate() -> None:
    model = synthetic(200)
    model.add(LoadObservation(0.0, float("nan"), 0.1, None))
    text = json.dumps(model.to_dict())
    restored = CapacityModel.from_dict(json.loads(text))
    assert restored.key == model.key
    assert restored.observations() == model.observations()
    assert restored.rejected == model.rejected
    assert restored.estimate(sla_ttft_p99_s=SLA_S) == model.estimate(sla_ttft_p99_s=SLA_S)


@pytest.mark.parametrize(("data", "where"), [
    ([], "expected an object"),
    ({"version": 99}, "version"),
    ({"version": 1, "key": {"model": "m"}}, "'key'"),
    ({"version": 1, "key": {"model": "m", "engine": "e", "engine_version": "1",
                            "gpu_model": "g"}, "observations": [[1, "x", 0.1, None]]},
     "observations[0]"),
])
def test_from_dict_rejects_bad_input_naming_the_field(data: object, where: str) -> None:
    with pytest.raises(InvalidArgument, match=f".*{where.replace('[', '.').replace(']', '.')}"):
        CapacityModel.from_dict(data)


def test_estimate_needs_a_valid_sla() -> None:
    model = synthetic(50)
    with pytest.raises(InvalidArgument, match="sla_ttft_p99_s or sla_itl_p99_s"):
        model.estimate()
    with pytest.raises(InvalidArgument, match="sla_ttft_p99_s must be > 0"):
        model.estimate(sla_ttft_p99_s=-1.0)


def test_gain_interval_contains_the_true_ratio() -> None:
    vllm = synthetic(300, 50.0, top=62.0, seed=4).estimate(sla_ttft_p99_s=SLA_S)
    trt = synthetic(300, 58.0, top=70.0, seed=5, engine="tensorrt-llm").estimate(
        sla_ttft_p99_s=SLA_S)
    g = gain(trt, vllm)
    assert g.status == "ok"
    assert g.low is not None and g.high is not None and g.ratio is not None
    assert g.low <= 58.0 / 50.0 <= g.high
    assert g.ratio == pytest.approx(1.16, rel=0.05)


def test_gain_of_bounds_and_missing_estimates() -> None:
    ok = synthetic(300).estimate(sla_ttft_p99_s=SLA_S)
    lower = synthetic(100, top=30.0).estimate(sla_ttft_p99_s=SLA_S)
    none = CapacityEstimate("insufficient_data", None, None, None, 0, 0.0, "no data")
    assert gain(lower, ok).status == "lower_bound"
    assert gain(ok, lower).status == "upper_bound"
    missing = gain(ok, none)
    assert missing.status == "insufficient_data" and missing.ratio is None
    assert missing.reason == "no data"
    assert gain(lower, lower).status == "insufficient_data"


def test_plot_writes_a_png(tmp_path: Path) -> None:
    model = synthetic(100)
    est = model.estimate(sla_ttft_p99_s=SLA_S, sla_itl_p99_s=1.0)
    out = plot_capacity(model, tmp_path / "cap.png", sla_ttft_p99_s=SLA_S, estimate=est)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = CapacityModel(CapacityKey("m", "vllm", "1", "H100"))
    assert plot_capacity(empty, tmp_path / "empty.png").stat().st_size > 0
    assert not math.isnan(est.capacity_rps or math.nan)


def _kept_by_definition(rows: list[tuple[float, float | None, float | None]],
                        per_bin: int) -> tuple[CapacityModel, list[LoadObservation]]:
    """The model fed `rows` (log10 load, ttft, itl), and what per-bin queues of observations
    keep: the newest `per_bin` of each load bin, and beyond MAX_BINS bins the one with the
    fewest (then the oldest newest observation) dropped."""
    model = CapacityModel(CapacityKey("m", "vllm", "1", "H100"), per_bin=per_bin)
    bins: dict[int, deque[LoadObservation]] = {}
    for i, (log_load, ttft, itl) in enumerate(rows):
        obs = LoadObservation(float(i), 10.0 ** log_load, ttft, itl)
        if model.add(obs) is not None:
            continue
        b = math.floor(math.log(obs.rps_per_replica) / math.log(BIN_RATIO))
        bins.setdefault(b, deque(maxlen=per_bin)).append(obs)
        if len(bins) > MAX_BINS:
            del bins[min(bins, key=lambda k: (len(bins[k]), bins[k][-1].ts))]
    return model, [o for b in sorted(bins) for o in bins[b]]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(-2.0, 4.0), st.sampled_from([None, 0.2, 0.7]),
                          st.sampled_from([None, 0.05])), min_size=1, max_size=300),
       st.integers(1, 4))
def test_kept_observations_are_the_plain_definition(rows: list[tuple[float, float | None,
                                                                     float | None]],
                                                    per_bin: int) -> None:
    """The compact store keeps what per-bin queues would; unmeasured latencies stay unmeasured."""
    model, expected = _kept_by_definition(rows, per_bin)
    assert model.observations() == expected
    assert len(model) == len(expected)


def test_beyond_max_bins_the_emptiest_oldest_bin_goes() -> None:
    rng = np.random.default_rng(4)
    loads = rng.uniform(-2.0, 4.0, 3000)  # about 700 load bins
    loads[::3] = 1.0  # one busy bin, never dropped
    model, expected = _kept_by_definition([(float(x), 0.2, None) for x in loads], 3)
    assert MAX_BINS < len(expected) <= 3 * MAX_BINS  # bins were dropped
    assert model.observations() == expected
    assert len(model) == len(expected)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(-2.0, 4.0), st.sampled_from([None, 0.2, 0.7, math.nan]),
                          st.sampled_from([None, 0.05])), min_size=1, max_size=300),
       st.integers(1, 4), st.lists(st.integers(0, 300), max_size=6))
def test_batches_keep_what_adding_one_by_one_keeps(rows: list[tuple[float, float | None,
                                                                    float | None]],
                                                   per_bin: int, cuts: list[int]) -> None:
    """`add_many` (one pass per batch) leaves the state `add` of each row leaves: the kept
    observations, the counts, and which bin goes first when bins are dropped later."""
    one = CapacityModel(CapacityKey("m", "vllm", "1", "H100"), per_bin=per_bin)
    batched = CapacityModel(CapacityKey("m", "vllm", "1", "H100"), per_bin=per_bin)
    obs = [LoadObservation(float(i), 10.0 ** x, ttft, itl) for i, (x, ttft, itl) in enumerate(rows)]
    kept = sum(one.add(o) is None for o in obs)
    edges = [0, *sorted(cuts), len(obs)]
    assert sum(batched.add_many(obs[a:b]) for a, b in itertools.pairwise(edges)) == kept
    assert batched.to_dict() == one.to_dict() and len(batched) == len(one)
    rng = np.random.default_rng(len(rows))
    more = [LoadObservation(1e4 + i, float(10.0 ** x), 0.2, None)
            for i, x in enumerate(rng.uniform(-2.0, 4.0, 2 * MAX_BINS))]
    for o in more:  # past MAX_BINS: the emptiest-oldest bins go, in the same order
        one.add(o)
    batched.add_many(more[:MAX_BINS // 2])
    for o in more[MAX_BINS // 2:]:
        batched.add(o)
    assert batched.to_dict() == one.to_dict()


def _crossing_by_fit(loads: np.ndarray, lat: np.ndarray, sla: float) -> float:
    """The SLA crossing of a full monotone fit (the definition the bootstrap must keep)."""
    x, fit = monotone_fit(loads, lat)
    above = np.nonzero(fit > sla)[0]
    if above.size == 0:
        return float(x[-1])
    j = int(above[0])
    if j == 0 or x[j] <= x[j - 1]:
        return float(x[max(j - 1, 0)])
    f0, f1, target = (math.log(max(v, 1e-9)) for v in (fit[j - 1], fit[j], sla))
    return float(x[j - 1] + (target - f0) / (f1 - f0) * (x[j] - x[j - 1]))


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(0, 60), spread=st.sampled_from([1.0, 9.0, 40.0]))
def test_outlier_mask_is_the_median_of_every_higher_load(seed: int, n: int, spread: float) -> None:
    """A p99 over OUTLIER_FACTOR x the median p99 of every higher load (np.median of the
    suffix) is flagged, whether or not the spread of the p99s lets the walk be skipped."""
    rng = np.random.default_rng(seed)
    loads = np.round(rng.uniform(1.0, 5.0, n), 1)  # ties in load
    lat = 0.1 * rng.uniform(1.0, spread, n) * rng.choice([1.0, 1.0, 1.0, 12.0], n)
    order = np.argsort(loads)  # the order the mask walks (ties as it breaks them)
    expected = np.zeros(n, dtype=bool)
    for rank in range(n):
        above = lat[order[rank + 1:]]
        i = order[rank]
        if above.size >= 3 and lat[i] > OUTLIER_FACTOR * max(float(np.median(above)), 1e-6):
            expected[i] = True
    assert outlier_mask(loads, lat).tolist() == expected.tolist()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(10, 300), sla=st.sampled_from([0.5, 1.0, 2.0]),
       knee=st.floats(1.5, 6.0), rounded=st.booleans())
def test_bootstrap_draws_are_those_of_a_fit_per_resample(seed: int, n: int, sla: float,
                                                         knee: float, rounded: bool) -> None:
    """Resamples clearly under the SLA skip the fit; every draw is still the full fit's."""
    rng = np.random.default_rng(seed)
    loads = rng.uniform(1.0, 3.0, n) * rng.choice([1.0, 1.5], n)
    if rounded:
        loads = np.round(loads, 1)  # ties in load
    lat = 0.3 * np.maximum(0.05, 1 - loads / knee) ** -0.5 * np.exp(0.05 * rng.standard_normal(n))
    _, est = estimate_metric("ttft", loads, lat, sla, 30, seed)
    if est.status == "insufficient_data":
        return
    draws = np.random.default_rng(seed)
    # The reference resamples the kept (non-outlier) observations, as the estimate does.
    keep = ~outlier_mask(loads, lat)
    kl, kt = loads[keep], lat[keep]
    expected = []
    for _ in range(30):
        pick = draws.integers(0, kl.size, kl.size)
        expected.append(_crossing_by_fit(kl[pick], kt[pick], sla))
    assert list(est.draws) == expected
