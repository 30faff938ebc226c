"""What the controller learns from the fleet: engine capacity per model, and traffic forecasts.

Capacity models (`gearshift.policies.capacity`) are fed one observation per
completed rollup minute — the request rate per ready replica and the p99
latencies — per (model, engine, engine version, GPU model), and persisted as
JSON settings (`capacity/<label>`) so a restarted controller keeps what it
learned. Forecasts are refitted at most every `FORECAST_REFIT_S` per model,
because a fit costs a fraction of a second.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gearshift.controller.errors import GearshiftError
from gearshift.controller.store import Store
from gearshift.controller.tables import RollupRow
from gearshift.policies.capacity import (
    CapacityEstimate,
    CapacityKey,
    CapacityModel,
    LoadObservation,
)
from gearshift.policies.forecast import Forecast, forecast_rate

log = logging.getLogger(__name__)

SETTING_PREFIX = "capacity/"
FORECAST_REFIT_S = 900.0
FORECAST_HORIZON_S = 24 * 3600.0
FORECAST_MIN_STEP_S = 300.0  # the forecast works on 5-minute bins (or the history's, if coarser)


@dataclass(frozen=True)
class LearnedCapacity:
    key: CapacityKey
    estimate: CapacityEstimate


class CapacityLearner:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.models: dict[CapacityKey, CapacityModel] = {}
        self._dirty: set[CapacityKey] = set()

    def load(self) -> None:
        for key, data in self.store.settings_with_prefix(SETTING_PREFIX).items():
            try:
                model = CapacityModel.from_dict(data, where=f"setting {key}")
            except Exception as exc:  # a damaged entry must not stop the controller
                log.warning("ignoring stored capacity model %s: %s", key, exc)
                continue
            self.models[model.key] = model

    def observe(self, rows: Iterable[RollupRow]) -> int:
        """Feed completed rollup minutes; returns how many observations were kept."""
        kept = 0
        for r in rows:
            if r.replicas <= 0 or r.ttft_p99_s is None:
                continue
            key = CapacityKey(r.model, r.engine, r.engine_version, r.gpu_model)
            model = self.models.setdefault(key, CapacityModel(key))
            obs = LoadObservation(ts=r.minute.timestamp() + 60.0,
                                  rps_per_replica=r.request_rate_mean / r.replicas,
                                  ttft_p99_s=r.ttft_p99_s, itl_p99_s=r.itl_p99_s)
            if model.add(obs) is None:
                kept += 1
                self._dirty.add(key)
        return kept

    def snapshot(self) -> dict[str, Any]:
        """What changed since the last snapshot, ready to store (cheap; on the caller's thread)."""
        out = {f"{SETTING_PREFIX}{key.label()}": self.models[key].to_dict() for key in self._dirty}
        self._dirty.clear()
        return out

    def save(self) -> None:
        """Store what changed, in one transaction (blocking: run it off the event loop)."""
        self.store.set_settings(self.snapshot())

    def for_model(self, model: str) -> list[CapacityModel]:
        return [m for k, m in sorted(self.models.items(), key=lambda kv: kv[0].label())
                if k.model == model]

    def best(self, model: str, engine: str, gpu_model: str | None,
             sla_ttft_p99_s: float | None, sla_itl_p99_s: float | None) -> LearnedCapacity | None:
        """The estimate from the model with the most points for this engine (and GPU)."""
        candidates = [m for k, m in self.models.items() if k.model == model and k.engine == engine
                      and (gpu_model is None or k.gpu_model == gpu_model)]
        if not candidates or (sla_ttft_p99_s is None and sla_itl_p99_s is None):
            return None
        chosen = max(candidates, key=len)
        return LearnedCapacity(chosen.key, chosen.estimate(sla_ttft_p99_s, sla_itl_p99_s))


class Forecaster:
    def __init__(self, history: Callable[[str], tuple[list[float], list[float]]],
                 step_s: float, clock: Callable[[], float] = time.time) -> None:
        self._history = history
        self._step_s = step_s
        self._clock = clock
        self._cache: dict[str, tuple[float, Forecast]] = {}

    def forecast(self, model: str, now: float | None = None) -> Forecast:
        now = self._clock() if now is None else now
        cached = self._cache.get(model)
        if cached is not None and now - cached[0] < FORECAST_REFIT_S:
            return cached[1]
        ts, rps = self._history(model)
        try:
            fc = forecast_rate(ts, rps, now, FORECAST_HORIZON_S,
                               step_s=max(self._step_s, FORECAST_MIN_STEP_S))
        except GearshiftError as exc:  # a forecast problem must never stop the policy loop
            fc = Forecast(status="insufficient_data", method="none", sustained_rps=None,
                          peak_rps=None, horizon_s=FORECAST_HORIZON_S, quantile=0.1,
                          reason=f"forecast failed: {exc.message}", points=len(ts))
        self._cache[model] = (now, fc)
        return fc
