"""Traffic forecast per model: the sustained (low-quantile) and peak request rate
over the policy's horizon, learned only from samples before `now`.

Method ("seasonal-gbm"): the rate history is put on a regular grid (one bin per
`step_s`, coarsened only when 28 days would exceed `MAX_TRAIN_ROWS` bins), then
two quantile gradient-boosting models (scikit-learn's
`HistGradientBoostingRegressor(loss="quantile")` trees, grown in numpy by
`policies.quantile_trees` bit for bit), at `quantile` and at `peak_quantile`)
predict every future bin of the horizon from

- calendar features: hour of day and day of week (UTC) as sin/cos pairs;
- lags that are already known at every step of the horizon: the rate one "day
  lag" earlier (1 day, or the smallest whole number of days >= the horizon) and
  one "week lag" earlier (7 days, or more for longer horizons), each smoothed
  over +-30 min;
- all in log space relative to the mean rate of the day ending at the day lag,
  so a growing or shrinking model is learned as a ratio the trees can apply at
  levels never seen in training.

The per-step paths are returned when asked for (`paths=True`, the default: the CLI's
JSON and plot); `decision_forecast` (the live controller's cache, the blind backtest)
asks for none, since a decision reads only the figures and `start_ts`: the controller
keeps about 10 KB a model (the forecast and its kept trees) instead of about 200 KB
(tracemalloc; the paths of a 7-day horizon at 5-minute bins are 3 x 2,016 floats as
tuples). `sustained_rps` is the `quantile`-quantile over
the horizon of the low path (so on a flat series it is the rate's low quantile,
and on a daily cycle it sits near the trough, like the `rps_sustained` signal of
a window), `peak_rps` is the highest value of the high path.

Cost: fitting the trees is most of a forecast's time (scikit-learn's tree grower
spends Python time per node). On 28 days of 5-minute bins and a 7-day horizon, on a
loaded 2-core machine, a forecast that fits its low model took 36 ms of CPU with 20
rounds of 7 leaves (`forecast_model.FIT_ROUNDS`, `FIT_LEAVES`) and 136 ms with the
former 60 rounds of 15 leaves; one from kept trees 7 ms (grid, features, the
drift check and the prediction; the features only of the rows it reads, the drift
window and the horizon, each row the whole matrix's to the bit: a test compares them). So a
forecast keeps its fitted trees (`Forecast.model`, a `forecast_model.SeasonalModel`)
and the next forecast of the same series (`kept=`) predicts from the current
history's features with them, refitting only when they are due (a week old, the
training rows doubled since, or the trees no longer fit the last day:
`policies.forecast_model` has the rule, which the blind backtest and the
controller share). Columns that cannot change a tree (constant,
or a copy of an earlier one: with a horizon of whole weeks the day and week lags
coincide) are dropped before fitting (`policies.forecast_features` builds the grid
and the features); `defer_peak=True` (the blind backtest, which reads the peak
only when a decision cites it) fits the peak model on first read of
`peak_rps`/`path_high` (`DeferredPeakForecast`, same figures); scikit-learn is
imported with the first fit, so a caller that never fits never loads it.

Fallbacks are results, never exceptions: with under `MIN_SEASONAL_HISTORY_S` of
history, or a constant series, the forecast is the recent low/high quantile
(`method="recent-quantile"`, with the reason); with too few valid samples, or
none recently, it is `status="insufficient_data"` with no numbers. NaN,
infinite and negative rates (e.g. a counter reset turned into a rate) and
extreme outliers are dropped and counted in the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
import numpy.typing as npt

from gearshift.common.errors import InvalidArgument
from gearshift.policies.forecast_features import SECONDS_PER_DAY as SECONDS_PER_DAY
from gearshift.policies.forecast_features import SECONDS_PER_HOUR as SECONDS_PER_HOUR
from gearshift.policies.forecast_features import SECONDS_PER_WEEK as SECONDS_PER_WEEK
from gearshift.policies.forecast_features import (
    FloatArray,
    daily_level,
    features,
    grid_means,
    median,
    no_day_lag_rows,
    quantiles,
    split_columns,
)
from gearshift.policies.forecast_model import DRIFT_WINDOW_S, ModelKey, SeasonalModel

TRAIN_WINDOW_S = 28 * SECONDS_PER_DAY      # history the seasonal model reads
MAX_TRAIN_ROWS = 9000                      # bins; coarser bins beyond this
MIN_SEASONAL_HISTORY_S = 2 * SECONDS_PER_DAY  # below: recent-quantile fallback
MIN_POINTS = 12                            # valid samples below which nothing is said
RECENT_WINDOW_S = SECONDS_PER_DAY          # window of the recent-quantile fallback
MIN_STALE_S = SECONDS_PER_HOUR             # no sample for max(this, 6 steps): no forecast
OUTLIER_MADS = 25.0                        # robust z above which a rate is an outlier
DEFAULT_PEAK_QUANTILE = 0.9
QUANTILE_MIN, QUANTILE_MAX = 0.01, 0.99    # the sustained quantile a decision forecast uses

Status = Literal["ok", "insufficient_data"]
Method = Literal["seasonal-gbm", "recent-quantile", "none"]


@dataclass(frozen=True)
class Forecast:
    """The rate forecast for one model over `horizon_s` after the origin `now`."""

    status: Status
    method: Method
    sustained_rps: float | None   # low quantile of the rate over the horizon
    peak_rps: float | None        # high quantile (the peak) over the horizon
    horizon_s: float
    quantile: float
    reason: str                   # why a fallback or no forecast; notes on dropped data
    points: int                   # valid samples before `now` that were used
    path_ts: tuple[float, ...] = ()    # start of each forecast bin (epoch s)
    path_low: tuple[float, ...] = ()   # per-bin `quantile` forecast
    path_high: tuple[float, ...] = ()  # per-bin `peak_quantile` forecast
    start_ts: float | None = None      # the origin `now`, the first bin's start (epoch s);
    #                                    None when no forecast was made
    # The fitted trees of a seasonal forecast, for the next forecast of the same series
    # to reuse (`forecast_rate(kept=...)`). Not a field: never compared or serialised.
    model: ClassVar[SeasonalModel | None] = None


class DeferredPeakForecast(Forecast):
    """A seasonal forecast whose peak model is fitted when `peak_rps` or `path_high` is
    first read: the same figures as the eager `Forecast`, one fit instead of two while
    only the sustained level is read (a backtest step reads the peak only when a
    decision cites it)."""

    def __init__(self, fit_peak: Callable[[], tuple[float, tuple[float, ...]]], *,
                 status: Status, method: Method, sustained_rps: float | None, horizon_s: float,
                 quantile: float, reason: str, points: int, path_ts: tuple[float, ...],
                 path_low: tuple[float, ...], start_ts: float,
                 model: SeasonalModel | None) -> None:
        for name, value in (("status", status), ("method", method),
                            ("sustained_rps", sustained_rps), ("horizon_s", horizon_s),
                            ("quantile", quantile), ("reason", reason), ("points", points),
                            ("path_ts", path_ts), ("path_low", path_low), ("start_ts", start_ts),
                            ("model", model), ("_fit_peak", fit_peak), ("_peak", None)):
            object.__setattr__(self, name, value)

    def _peak_fitted(self) -> tuple[float, tuple[float, ...]]:
        peak: tuple[float, tuple[float, ...]] | None = self.__dict__["_peak"]
        if peak is None:
            peak = self.__dict__["_fit_peak"]()
            object.__setattr__(self, "_peak", peak)
            object.__setattr__(self, "_fit_peak", None)  # the training data goes with it
        return peak

    @property  # type: ignore[override]
    def peak_rps(self) -> float | None:
        return self._peak_fitted()[0]

    @property  # type: ignore[override]
    def path_high(self) -> tuple[float, ...]:
        return self._peak_fitted()[1]


def _check_args(now: float, horizon_s: float, step_s: float, quantile: float,
                peak_quantile: float) -> None:
    for name, value in (("now", now), ("horizon_s", horizon_s), ("step_s", step_s)):
        if not math.isfinite(value):
            raise InvalidArgument(f"forecast_rate: {name} must be finite, got {value}")
    if horizon_s <= 0 or step_s <= 0:
        raise InvalidArgument(
            f"forecast_rate: horizon_s and step_s must be > 0, got {horizon_s} and {step_s}")
    if horizon_s / step_s > MAX_TRAIN_ROWS:
        raise InvalidArgument(f"forecast_rate: horizon_s/step_s = {horizon_s / step_s:.0f} "
                              f"bins is more than {MAX_TRAIN_ROWS}")
    for name, q in (("quantile", quantile), ("peak_quantile", peak_quantile)):
        if not 0.0 < q < 1.0:
            raise InvalidArgument(f"forecast_rate: {name} must be in (0, 1), got {q}")


def _none(reason: str, horizon_s: float, quantile: float, points: int) -> Forecast:
    return Forecast("insufficient_data", "none", None, None, horizon_s, quantile, reason, points)


def forecast_rate(ts: npt.ArrayLike, rps: npt.ArrayLike, now: float, horizon_s: float, *,
                  step_s: float = 300.0, quantile: float = 0.1,
                  peak_quantile: float = DEFAULT_PEAK_QUANTILE,
                  defer_peak: bool = False, kept: SeasonalModel | None = None,
                  paths: bool = True) -> Forecast:
    """Forecast the rate over (now, now + horizon_s] from the samples with ts < now.

    `ts` are epoch seconds (any order), `rps` the request rate of each sample,
    `step_s` the sampling period. Bad data gives a fallback or an
    "insufficient_data" result with the reason; only bad arguments raise
    `InvalidArgument`. `defer_peak`: a seasonal forecast fits its peak model only
    when the peak is first read (`DeferredPeakForecast`; same figures). `kept`: the
    `model` of an earlier forecast of the same series; its trees predict from the
    current history's features unless `SeasonalModel.due` says they must be refitted.
    `paths=False`: no per-bin paths (empty tuples), the same figures and `start_ts`.
    """
    _check_args(now, horizon_s, step_s, quantile, peak_quantile)
    times = np.asarray(ts, dtype=np.float64).ravel()
    rates = np.asarray(rps, dtype=np.float64).ravel()
    if times.shape != rates.shape:
        return _none(f"{times.size} timestamps but {rates.size} rates", horizon_s, quantile, 0)
    # Each filter below is skipped when its bounds show that it keeps every sample (the
    # usual case: one min and max instead of a mask and a copy; NaN fails the bounds).
    if not (times.size and float(times.min()) >= now - TRAIN_WINDOW_S
            and float(times.max()) < now):
        past = np.isfinite(times) & (times < now) & (times >= now - TRAIN_WINDOW_S)
        times, rates = times[past], rates[past]
    notes: list[str] = []
    top = float(rates.max()) if rates.size else math.nan
    if not (rates.size and float(rates.min()) >= 0 and top < math.inf):
        valid = np.isfinite(rates) & (rates >= 0)
        if (bad := int((~valid).sum())):
            notes.append(f"dropped {bad} NaN/infinite/negative rate(s)")
        times, rates = times[valid], rates[valid]
        top = float(rates.max()) if rates.size else math.nan
    if rates.size:
        med = median(rates)
        mad = median(np.abs(rates - med)) * 1.4826
        limit = med + OUTLIER_MADS * max(mad, 0.05 * med, 1e-9)
        if not top <= limit:
            keep = rates <= limit
            if (outliers := int((~keep).sum())):
                notes.append(f"dropped {outliers} outlier(s) above {limit:.3g} rps")
            times, rates = times[keep], rates[keep]
    points = int(rates.size)
    if points < MIN_POINTS:
        return _none("; ".join([f"insufficient data: {points} valid rate sample(s) before now, "
                                f"need {MIN_POINTS}", *notes]), horizon_s, quantile, points)
    stale_s = max(MIN_STALE_S, 6 * step_s)
    if (last := float(times.max())) < now - stale_s:
        return _none("; ".join([f"insufficient data: no rate sample in the last "
                                f"{(now - last) / 3600:.1f} h (gap longer than "
                                f"{stale_s / 3600:.1f} h)", *notes]), horizon_s, quantile, points)
    bin_s = step_s * max(1, math.ceil(TRAIN_WINDOW_S / step_s / MAX_TRAIN_ROWS))
    future_bins = max(1, math.ceil(horizon_s / bin_s - 1e-9))
    path_ts = now + bin_s * np.arange(future_bins if paths else 0, dtype=np.float64)
    span_s = now - float(times.min())
    recent = rates[times >= now - RECENT_WINDOW_S]
    if float(rates.max()) - float(rates.min()) <= 1e-9 * max(1.0, abs(float(rates[0]))):
        notes.insert(0, "constant series: nothing seasonal to learn")
    elif span_s < MIN_SEASONAL_HISTORY_S:
        notes.insert(0, f"only {span_s / 3600:.1f} h of history; the seasonal model needs "
                        f"{MIN_SEASONAL_HISTORY_S / 3600:.0f} h")
    else:
        return _seasonal(times, rates, now, ModelKey(horizon_s, bin_s, quantile, peak_quantile),
                         future_bins, path_ts, points, notes, defer_peak, kept)
    return _recent(recent, now, quantile, peak_quantile, horizon_s, "; ".join(notes), points,
                   path_ts)


def _recent(recent: FloatArray, now: float, quantile: float, peak_quantile: float,
            horizon_s: float, reason: str, points: int, path_ts: FloatArray) -> Forecast:
    """The recent-quantile fallback: flat paths at the recent low and high quantiles."""
    low, high = quantiles(recent, (quantile, peak_quantile))
    bins = path_ts.size
    return Forecast("ok", "recent-quantile", low, high, horizon_s, quantile, reason, points,
                    tuple(path_ts.tolist()), (low,) * bins, (high,) * bins, start_ts=now)


def _seasonal(times: FloatArray, rates: FloatArray, now: float, key: ModelKey,
              future_bins: int, path_ts: FloatArray, points: int, notes: list[str],
              defer_peak: bool, kept: SeasonalModel | None) -> Forecast:
    """The seasonal forecast of `future_bins` bins; `path_ts` is empty when no paths
    are kept."""
    horizon_s, bin_s, quantile = key.horizon_s, key.bin_s, key.quantile
    past_bins = math.ceil(TRAIN_WINDOW_S / bin_s)
    day_lag = max(1, round(SECONDS_PER_DAY * math.ceil(horizon_s / SECONDS_PER_DAY - 1e-9) / bin_s))
    week_lag = max(1, round(SECONDS_PER_WEEK * math.ceil(horizon_s / SECONDS_PER_WEEK - 1e-9)
                            / bin_s))
    train = None
    if not no_day_lag_rows(times, now, bin_s, past_bins, day_lag):
        grid = grid_means(times, rates, now, bin_s, past_bins, future_bins)
        day_mean, level = daily_level(grid, bin_s, day_lag)
        target = np.log1p(grid) - level
        train = np.isfinite(target[:past_bins])
    # Checked before the other features are built: while the day lag reaches before
    # the history (the first days of a model) this is every call, and a cheap one.
    if train is None or int(train.sum()) < max(MIN_POINTS, round(SECONDS_PER_DAY / bin_s) // 2):
        notes.insert(0, "too few samples with a known day-lag to train the seasonal model")
        return _recent(rates[times >= now - RECENT_WINDOW_S], now, quantile, key.peak_quantile,
                       horizon_s, "; ".join(notes), points, path_ts)
    bin_ts = now + bin_s * np.arange(-past_bins, future_bins, dtype=np.float64)

    def rows(start: int, stop: int | None = None) -> FloatArray:
        return features(grid, bin_ts, bin_s, day_mean, level, day_lag, week_lag, start, stop)

    future_level = level[past_bins:]
    if not np.all(np.isfinite(future_level)):
        # Gap a day before: fall back to the latest known daily level.
        known = level[:past_bins][np.isfinite(level[:past_bins])]
        future_level = np.where(np.isfinite(future_level), future_level,
                                known[-1] if known.size else float(np.log1p(np.mean(rates))))
    train_rows = int(train.sum())
    # Kept trees need the features of the drift window and the horizon only; a fit, all.
    tail = int(np.searchsorted(bin_ts[:past_bins], now - DRIFT_WINDOW_S, side="left"))
    x = None
    if kept is not None and not kept.due(key, now, train_rows):
        x_tail = rows(tail)
        recent = train[tail:]
        if kept.drifted(x_tail[:past_bins - tail][recent], target[tail:past_bins][recent]):
            x = np.concatenate([rows(0, tail), x_tail])
        else:
            model, x_future = kept, x_tail[past_bins - tail:][:, kept.columns]
    else:
        x = rows(0)
    if x is not None:
        x_train = x[:past_bins][train]
        columns = split_columns(x_train)
        model = SeasonalModel.fit(key, now, columns, x_train[:, columns],
                                  target[:past_bins][train], defer_peak=defer_peak)
        x_future = x[past_bins:][:, model.columns]
    low_path = np.maximum(0.0, np.expm1(model.low.predict(x_future) + future_level))

    keep = path_ts.size > 0

    def fit_peak() -> tuple[float, tuple[float, ...]]:
        high_path = np.maximum(0.0, np.expm1(model.peak().predict(x_future) + future_level))
        high_path = np.maximum(high_path, low_path)
        return float(np.max(high_path)), tuple(high_path.tolist()) if keep else ()

    sustained = quantiles(low_path, (quantile,))[0]
    reason, bins_ts = "; ".join(notes), tuple(path_ts.tolist())
    low_bins = tuple(low_path.tolist()) if keep else ()
    if defer_peak:
        return DeferredPeakForecast(fit_peak, status="ok", method="seasonal-gbm",
                                    sustained_rps=sustained, horizon_s=horizon_s,
                                    quantile=quantile, reason=reason, points=points,
                                    path_ts=bins_ts, path_low=low_bins, start_ts=now, model=model)
    peak, high_bins = fit_peak()
    fc = Forecast("ok", "seasonal-gbm", sustained, peak, horizon_s, quantile, reason, points,
                  bins_ts, low_bins, high_bins, start_ts=now)
    object.__setattr__(fc, "model", model)
    return fc


def decision_forecast(ts: npt.ArrayLike, rps: npt.ArrayLike, now: float, horizon_s: float, *,
                      step_s: float, quantile: float, defer_peak: bool = False,
                      kept: SeasonalModel | None = None) -> Forecast:
    """`forecast_rate` as the decision paths (live loop, blind backtest) call it: without
    the per-bin paths (a decision reads the figures and `start_ts`; the live cache holds
    one forecast per model), the
    policy's sustained quantile clamped into [QUANTILE_MIN, QUANTILE_MAX] (a policy may
    say 0 or 1), and a bad argument (a horizon too long for the step, …) turned into
    an ``insufficient_data`` result with the reason: a forecast never stops a decision."""
    q = min(max(quantile, QUANTILE_MIN), QUANTILE_MAX)
    try:
        return forecast_rate(ts, rps, now, horizon_s, step_s=step_s, quantile=q,
                             defer_peak=defer_peak, kept=kept, paths=False)
    except InvalidArgument as exc:
        return Forecast("insufficient_data", "none", None, None, horizon_s, q,
                        f"forecast failed: {exc.message}", 0)


def pinball_loss(actual: npt.ArrayLike, predicted: npt.ArrayLike, quantile: float) -> float:
    """Mean pinball (quantile) loss of `predicted` against `actual` at `quantile`."""
    diff = np.asarray(actual, dtype=np.float64) - np.asarray(predicted, dtype=np.float64)
    return float(np.mean(np.maximum(quantile * diff, (quantile - 1.0) * diff)))


def plot_forecast(ts: npt.ArrayLike, rps: npt.ArrayLike, forecast: Forecast, path: str | Path,
                  *, title: str = "") -> Path:
    """Write a PNG: the recent history, the forecast band and the sustained/peak levels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = np.asarray(ts, dtype=np.float64)
    rates = np.asarray(rps, dtype=np.float64)
    origin = forecast.path_ts[0] if forecast.path_ts else (float(times.max()) if times.size else 0.0)
    shown = (times >= origin - 3 * SECONDS_PER_DAY) & (times < origin)
    fig, ax = plt.subplots(figsize=(10, 4))
    try:
        ax.plot((times[shown] - origin) / 3600, rates[shown], lw=0.8, color="0.3", label="observed")
        if forecast.path_ts:
            hours = (np.asarray(forecast.path_ts) - origin) / 3600
            ax.fill_between(hours, forecast.path_low, forecast.path_high, alpha=0.3,
                            step="post", label="forecast band")
        for value, name, style in ((forecast.sustained_rps, "sustained", "--"),
                                   (forecast.peak_rps, "peak", ":")):
            if value is not None:
                ax.axhline(value, ls=style, color="C1", label=f"{name} {value:.3g} rps")
        ax.axvline(0.0, color="k", lw=0.5)
        ax.set_xlabel("hours from now")
        ax.set_ylabel("requests/s")
        status = forecast.method if forecast.status == "ok" else forecast.status
        ax.set_title(f"{title} forecast ({status})".strip())
        if forecast.reason:
            ax.text(0.01, 0.98, forecast.reason, transform=ax.transAxes, va="top", fontsize=7)
        ax.legend(loc="lower left", fontsize=7)
        out = Path(path)
        fig.savefig(out, dpi=90)
    finally:
        plt.close(fig)
    return out
