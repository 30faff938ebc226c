"""Traffic forecast: only the past, beats last week on a seasonal series, fallbacks, plot."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest

from gearshift.common.errors import InvalidArgument
from gearshift.policies.forecast import (
    SECONDS_PER_DAY,
    SECONDS_PER_WEEK,
    DeferredPeakForecast,
    Forecast,
    forecast_rate,
    pinball_loss,
    plot_forecast,
)
from gearshift.policies.forecast_features import median, no_day_lag_rows, quantiles

STEP_S = 300.0
START = 1_772_409_600.0   # 2026-03-02T00:00:00Z, a Monday
HORIZON_S = SECONDS_PER_DAY


def seasonal(days: float, *, seed: int = 0, base: float = 100.0) -> tuple[np.ndarray, np.ndarray]:
    """Daily cycle, quieter weekends, lognormal noise."""
    rng = np.random.default_rng(seed)
    ts = START + STEP_S * np.arange(int(days * SECONDS_PER_DAY / STEP_S))
    hour = (ts % SECONDS_PER_DAY) / 3600
    weekend = (((ts // SECONDS_PER_DAY) + 3) % 7) >= 5
    level = base * (1 + 0.5 * np.sin(2 * np.pi * (hour - 8) / 24)) * np.where(weekend, 0.6, 1.0)
    return ts, level * rng.lognormal(0, 0.15, ts.size)


def test_only_the_past_is_used() -> None:
    ts, rps = seasonal(10)
    now = START + 8 * SECONDS_PER_DAY
    first = forecast_rate(ts, rps, now, HORIZON_S, step_s=STEP_S)
    changed = rps.copy()
    changed[ts >= now] *= 50.0
    second = forecast_rate(ts, changed, now, HORIZON_S, step_s=STEP_S)
    assert first.status == "ok" and first.method == "seasonal-gbm"
    assert first == second


def test_beats_same_time_last_week_on_a_seasonal_series() -> None:
    ts, rps = seasonal(16, seed=2)
    steps = int(HORIZON_S / STEP_S)
    week = int(SECONDS_PER_WEEK / STEP_S)
    model, baseline = [], []
    for day in (14, 15):
        now = START + day * SECONDS_PER_DAY
        fc = forecast_rate(ts, rps, now, HORIZON_S, step_s=STEP_S, quantile=0.1)
        first = int(np.searchsorted(ts, now))
        actual = rps[first:first + steps]
        assert len(fc.path_low) == steps
        model.append(pinball_loss(actual, fc.path_low, 0.1))
        baseline.append(pinball_loss(actual, rps[first - week:first - week + steps], 0.1))
        assert fc.sustained_rps is not None and fc.peak_rps is not None
        assert 0 < fc.sustained_rps < float(np.median(actual)) < fc.peak_rps
    assert np.mean(model) < 0.8 * np.mean(baseline)


def test_short_history_falls_back_to_the_recent_quantile() -> None:
    ts, rps = seasonal(1)
    fc = forecast_rate(ts, rps, ts[-1] + STEP_S, HORIZON_S, step_s=STEP_S)
    assert fc.status == "ok" and fc.method == "recent-quantile"
    assert "h of history" in fc.reason
    assert fc.sustained_rps == pytest.approx(float(np.quantile(rps, 0.1)))
    assert fc.peak_rps == pytest.approx(float(np.quantile(rps, 0.9)))


def test_constant_series_is_a_flat_fallback() -> None:
    ts = START + STEP_S * np.arange(3000)
    fc = forecast_rate(ts, np.full(ts.size, 7.0), ts[-1] + STEP_S, HORIZON_S, step_s=STEP_S)
    assert fc.method == "recent-quantile" and "constant" in fc.reason
    assert fc.sustained_rps == fc.peak_rps == 7.0


@pytest.mark.parametrize(("ts", "rps", "expected"), [
    ([START, START + STEP_S], [1.0, 2.0], "2 valid rate sample"),
    (START + STEP_S * np.arange(50), np.full(50, np.nan), "0 valid"),
    (START + STEP_S * np.arange(50), -np.ones(50), "negative"),
    ([START, START + 1], [1.0], "2 timestamps but 1 rates"),
])
def test_too_little_data_is_insufficient(ts: object, rps: object, expected: str) -> None:
    fc = forecast_rate(ts, rps, START + 60 * STEP_S, HORIZON_S, step_s=STEP_S)  # type: ignore[arg-type]
    assert fc.status == "insufficient_data" and fc.method == "none"
    assert fc.sustained_rps is None and fc.peak_rps is None
    assert expected in fc.reason


def test_a_recent_gap_is_insufficient() -> None:
    ts, rps = seasonal(5)
    fc = forecast_rate(ts, rps, ts[-1] + 2 * SECONDS_PER_DAY, HORIZON_S, step_s=STEP_S)
    assert fc.status == "insufficient_data" and "no rate sample in the last" in fc.reason


def test_counter_resets_and_outliers_are_dropped_and_reported() -> None:
    ts, rps = seasonal(4)
    dirty = rps.copy()
    dirty[100] = -250.0          # a counter reset turned into a negative rate
    dirty[200] = np.inf
    dirty[300] = 1e7             # a spike no engine served
    fc = forecast_rate(ts, dirty, ts[-1] + STEP_S, HORIZON_S, step_s=STEP_S)
    clean = forecast_rate(np.delete(ts, [100, 200, 300]), np.delete(rps, [100, 200, 300]),
                          ts[-1] + STEP_S, HORIZON_S, step_s=STEP_S)
    assert fc.status == "ok" and fc.method == "seasonal-gbm"
    assert "dropped 2 NaN/infinite/negative" in fc.reason and "1 outlier" in fc.reason
    assert replace(fc, reason="", points=0) == replace(clean, reason="", points=0)


def test_gaps_inside_the_history_still_forecast() -> None:
    ts, rps = seasonal(9)
    keep = ~((ts > START + 3 * SECONDS_PER_DAY) & (ts < START + 5 * SECONDS_PER_DAY))
    fc = forecast_rate(ts[keep], rps[keep], ts[-1] + STEP_S, HORIZON_S, step_s=STEP_S)
    assert fc.status == "ok" and fc.method == "seasonal-gbm"
    assert all(np.isfinite(fc.path_low)) and min(fc.path_low) >= 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"horizon_s": 0.0}, "horizon_s and step_s must be > 0"),
    ({"step_s": float("nan")}, "step_s must be finite"),
    ({"quantile": 1.5}, "quantile must be in"),
])
def test_bad_arguments_raise_a_clear_error(kwargs: dict[str, float], message: str) -> None:
    args = {"horizon_s": HORIZON_S, "step_s": STEP_S, "quantile": 0.1} | kwargs
    with pytest.raises(InvalidArgument, match=message):
        forecast_rate([START], [1.0], START + 1, args["horizon_s"], step_s=args["step_s"],
                      quantile=args["quantile"])


def test_plot_writes_a_png(tmp_path: Path) -> None:
    ts, rps = seasonal(1)
    fc = forecast_rate(ts, rps, ts[-1] + STEP_S, HORIZON_S, step_s=STEP_S)
    out = plot_forecast(ts, rps, fc, tmp_path / "fc.png", title="llama")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = Forecast("insufficient_data", "none", None, None, HORIZON_S, 0.1, "no data", 0)
    assert plot_forecast([], [], empty, tmp_path / "none.png").stat().st_size > 0


def test_a_deferred_peak_gives_the_eager_forecast() -> None:
    ts, rps = seasonal(16)
    now = START + 15 * SECONDS_PER_DAY
    eager = forecast_rate(ts, rps, now, SECONDS_PER_WEEK, step_s=STEP_S, quantile=0.1)
    deferred = forecast_rate(ts, rps, now, SECONDS_PER_WEEK, step_s=STEP_S, quantile=0.1,
                             defer_peak=True)
    assert eager.method == "seasonal-gbm"
    assert isinstance(deferred, DeferredPeakForecast)
    assert deferred.sustained_rps == eager.sustained_rps  # read before the peak is fitted
    assert asdict(deferred) == asdict(eager)
    # A fallback has nothing to defer: it is the plain forecast.
    young = forecast_rate(ts, rps, START + 3 * SECONDS_PER_DAY, SECONDS_PER_WEEK, step_s=STEP_S,
                          defer_peak=True)
    assert type(young) is Forecast and young.method == "recent-quantile"


@pytest.mark.parametrize(("days", "defer_peak", "method"), [
    (15, False, "seasonal-gbm"), (15, True, "seasonal-gbm"), (1, False, "recent-quantile"),
    (0, False, "none")])
def test_a_forecast_without_paths_has_the_same_figures(days: float, defer_peak: bool,
                                                        method: str) -> None:
    """The decision paths (the controller's cache of a forecast per model, the blind
    backtest) keep no per-bin paths: every other field is the forecast's with paths,
    `start_ts` its first bin's start."""
    ts, rps = seasonal(16)
    now = START + days * SECONDS_PER_DAY
    full = forecast_rate(ts, rps, now, SECONDS_PER_WEEK, step_s=STEP_S, defer_peak=defer_peak)
    bare = forecast_rate(ts, rps, now, SECONDS_PER_WEEK, step_s=STEP_S, defer_peak=defer_peak,
                         paths=False)
    assert full.method == method and len(full.path_low) == (0 if days == 0 else 2016)
    assert full.start_ts == (full.path_ts[0] if full.path_ts else None)
    assert bare.path_ts == bare.path_low == bare.path_high == ()
    assert ({k: v for k, v in asdict(bare).items() if not k.startswith("path_")}
            == {k: v for k, v in asdict(full).items() if not k.startswith("path_")})


def _varied_arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    arrays = [np.array([3.0]), np.array([0.0, 0.0]), np.array([1.0, 2.0]), np.zeros(5)]
    for n in (3, 4, 11, 12, 287, 288, 2016, 2017):
        arrays.append(rng.lognormal(3, 1, n))
        arrays.append(np.round(rng.lognormal(1, 1, n), 1))  # many ties
        idle = rng.lognormal(2, 0.5, n)
        idle[rng.random(n) < 0.4] = 0.0                     # idle steps
        arrays.append(idle)
        arrays.append(rng.lognormal(2, 0.5, n).astype(np.float32).astype(np.float64))
    return arrays


@pytest.mark.parametrize("qs", [(0.1, 0.9), (0.01, 0.99), (0.5,), (0.25, 0.75, 1.0, 0.0),
                                (1 / 3, 2 / 3)])
def test_order_statistics_are_numpys_to_the_bit(qs: tuple[float, ...]) -> None:
    for values in _varied_arrays():
        assert median(values.copy()) == float(np.median(values))
        assert median(np.abs(values - 1.5)) == float(np.median(np.abs(values - 1.5)))
        got = quantiles(values, qs)
        assert got == [float(v) for v in np.quantile(values, list(qs))]
        assert [quantiles(values, (q,))[0] for q in qs] == [float(np.quantile(values, q))
                                                           for q in qs]


def test_the_recent_quantile_fallback_gives_numpys_figures() -> None:
    """The first days of a model, hour by hour (the blind backtest's fallbacks): idle
    stretches, a gap, a spike and bad rates; the figures are numpy's quantiles of the
    filtered last day, the outlier limit numpy's median and MAD."""
    rng = np.random.default_rng(3)
    ts = START + STEP_S * np.arange(int(3 * SECONDS_PER_DAY / STEP_S))
    rps = rng.lognormal(3, 0.4, ts.size)
    rps[100:160] = 0.0                        # idle
    rps[400] = 1e6                            # outlier
    rps[500] = np.nan
    rps[501] = -1.0
    keep = (ts < START + 1.2 * SECONDS_PER_DAY) | (ts >= START + 1.5 * SECONDS_PER_DAY)  # gap
    ts, rps = ts[keep], rps[keep]
    checked = 0
    for now in START + 3600.0 * np.arange(2, 72):
        fc = forecast_rate(ts, rps, now, SECONDS_PER_WEEK, step_s=STEP_S, quantile=0.1,
                           paths=False)
        past = (ts < now) & np.isfinite(rps) & (rps >= 0)
        rates, times = rps[past], ts[past]
        if rates.size < 12 or fc.status != "ok":
            continue
        med = float(np.median(rates))
        mad = float(np.median(np.abs(rates - med))) * 1.4826
        limit = med + 25.0 * max(mad, 0.05 * med, 1e-9)
        recent = rates[(rates <= limit) & (times >= now - SECONDS_PER_DAY)]
        assert fc.method == "recent-quantile"
        low, high = (float(v) for v in np.quantile(recent, [0.1, 0.9]))
        assert (fc.sustained_rps, fc.peak_rps) == (low, high)
        assert fc.points == int((rates <= limit).sum())
        if (rates > limit).any():
            assert f"above {limit:.3g} rps" in fc.reason
        checked += 1
    assert checked > 60


@pytest.mark.parametrize("seed", range(6))
def test_the_filters_skipped_on_clean_samples_give_the_masked_forecast(seed: int) -> None:
    """The past, validity and outlier filters are skipped when the samples' bounds show
    that they keep every sample: the forecast is the one of the samples kept by the masks,
    whatever the order, and the notes count what the masks drop."""
    rng = np.random.default_rng(seed)
    ts, rps = seasonal(9, seed=seed)
    now = float(ts[-1]) + STEP_S
    order = rng.permutation(ts.size)
    clean = forecast_rate(ts[order], rps[order], now, SECONDS_PER_DAY, step_s=STEP_S,
                          paths=False)
    dirty_ts = np.concatenate([ts, [now, now + 1.0, np.nan, now - 60 * SECONDS_PER_DAY,
                                    float(ts[5]), float(ts[6]), float(ts[7])]])
    dirty_rps = np.concatenate([rps, [1.0, 1.0, 1.0, 1.0, np.nan, -1.0, np.inf]])
    dirty = forecast_rate(dirty_ts, dirty_rps, now, SECONDS_PER_DAY, step_s=STEP_S,
                          paths=False)
    assert dirty.reason == "dropped 3 NaN/infinite/negative rate(s)"
    assert replace(dirty, reason="") == clean
    spike = forecast_rate(np.append(ts, now - STEP_S / 2), np.append(rps, 1e9), now,
                          SECONDS_PER_DAY, step_s=STEP_S, paths=False)
    assert "dropped 1 outlier(s)" in spike.reason
    assert replace(spike, reason="") == replace(clean, reason="")


@pytest.mark.parametrize("seed", range(20))
def test_no_day_lag_rows_from_the_extremes_is_the_masked_answer(seed: int) -> None:
    """`no_day_lag_rows` read from the earliest and latest sample when both fall inside the
    grid is the answer of the bins of every sample."""
    rng = np.random.default_rng(seed)
    now, bin_s, past_bins, day_lag = START, STEP_S, 8064, 288
    span = rng.choice([0.5, 1.0, 1.0 + 1e-9, 2.0, 29.0]) * SECONDS_PER_DAY
    times = now - rng.uniform(0.0, span, int(rng.integers(0, 50)))
    if seed % 4 == 1:
        times = np.append(times, [now - 28 * SECONDS_PER_DAY, now - SECONDS_PER_DAY])
    if seed % 4 == 2:
        times = np.append(times, [np.nan, np.inf, now])

    def masked() -> bool:
        index = np.floor((times - now) / bin_s).astype(np.int64) + past_bins
        inside = index[(index >= 0) & (index < past_bins)]
        return inside.size == 0 or int(inside.max()) - int(inside.min()) < day_lag

    with np.errstate(invalid="ignore"):
        expected = masked()
        assert no_day_lag_rows(times, now, bin_s, past_bins, day_lag) == expected
