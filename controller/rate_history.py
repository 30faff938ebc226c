"""Per-model request-rate samples in memory, at a fixed resolution, for the policy.

`RateHistory` is what the policy loop's signals and forecasts read; it is bounded
(`HISTORY_RETENTION_S`) and a restarted controller seeds it from the stored
per-minute rollups. Each model's samples live in two fixed-size numpy rings (time
and rate, 16 bytes a sample) rather than a deque of tuples (about 120 bytes a
sample): a fleet of 10,000 models keeps a week at 5-minute resolution in a few
hundred MB, and reading a model's history is one copy, not a walk over Python
objects.
"""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import numpy.typing as npt

from gearshift.controller.store import Store

HISTORY_RETENTION_S = 8 * 24 * 3600.0
INITIAL_CAPACITY = 64  # samples; a ring grows by doubling up to the retention's count

FloatArray = npt.NDArray[np.float64]


class _Ring:
    """The newest `limit` (time, rate) samples, oldest first when read."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._data = np.empty((2, min(INITIAL_CAPACITY, limit)), dtype=np.float64)
        self._start = 0  # index of the oldest sample
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def last_ts(self) -> float:
        cap = self._data.shape[1]
        return float(self._data[0, (self._start + self._size - 1) % cap])

    def append(self, ts: float, rps: float) -> None:
        cap = self._data.shape[1]
        if self._size == cap and cap < self._limit:
            self._data = np.concatenate([self.arrays_2d(), np.empty((2, min(cap * 2, self._limit) - cap))],
                                        axis=1)
            self._start, cap = 0, self._data.shape[1]
        if self._size < cap:
            self._data[:, (self._start + self._size) % cap] = (ts, rps)
            self._size += 1
        else:  # full at the limit: overwrite the oldest
            self._data[:, self._start] = (ts, rps)
            self._start = (self._start + 1) % cap

    def extend(self, ts: FloatArray, rps: FloatArray) -> None:
        """`append` of each (ts[i], rps[i]) in order, at once."""
        data = np.concatenate([self.arrays_2d(), np.stack([ts, rps]).astype(np.float64)], axis=1)
        data = data[:, -self._limit:]
        cap = self._data.shape[1]
        while cap < data.shape[1]:  # the capacity appends would have grown to
            cap = min(cap * 2, self._limit)
        self._data = np.empty((2, cap), dtype=np.float64)
        self._data[:, :data.shape[1]] = data
        self._start, self._size = 0, data.shape[1]

    def arrays_2d(self) -> FloatArray:
        cap = self._data.shape[1]
        end = self._start + self._size
        if end <= cap:
            return self._data[:, self._start:end].copy()
        return np.concatenate([self._data[:, self._start:], self._data[:, :end - cap]], axis=1)


class RateHistory:
    """Per-model request-rate samples at a fixed resolution, in memory and bounded."""

    def __init__(self, resolution_s: float, retention_s: float = HISTORY_RETENTION_S) -> None:
        self.resolution_s = resolution_s
        self._max = max(10, int(retention_s / resolution_s))
        self._samples: dict[str, _Ring] = {}
        self._last_sample = 0.0

    def due(self, now: float) -> bool:
        return now - self._last_sample >= self.resolution_s * 0.999

    def sample(self, now: float, rates: dict[str, float]) -> None:
        self._last_sample = now
        for model, rps in rates.items():
            q = self._ring(model)
            if len(q) and now - q.last_ts() < self.resolution_s * 0.5:
                continue
            q.append(now, rps)

    def seed(self, store: Store, now: float) -> None:
        """Start from the stored per-minute rollups (a restarted controller keeps its memory)."""
        since = datetime.fromtimestamp(now - self._max * self.resolution_s, UTC)
        per_minute: dict[str, dict[float, float]] = {}
        for r in store.rollups(since=since):
            ts = r.minute.timestamp() + 60.0
            bucket = per_minute.setdefault(r.model, {})
            bucket[ts] = bucket.get(ts, 0.0) + r.request_rate_mean
        for model, points in per_minute.items():
            times = sorted(points)
            self.extend(model, times, [points[t] for t in times])

    def extend(self, model: str, ts: npt.ArrayLike, rps: npt.ArrayLike) -> None:
        """Append `model`'s samples (times ascending, after its newest) at once, as seeding
        from stored history does: the bulk form of one sample per step."""
        times = np.asarray(ts, dtype=np.float64).ravel()
        rates = np.asarray(rps, dtype=np.float64).ravel()
        if times.shape != rates.shape:
            raise ValueError(f"{times.size} sample times but {rates.size} rates")
        if times.size:
            self._ring(model).extend(times, rates)

    def _ring(self, model: str) -> _Ring:
        q = self._samples.get(model)
        if q is None:
            q = self._samples[model] = _Ring(self._max)
        return q

    def models(self) -> list[str]:
        return sorted(self._samples)

    def arrays(self, model: str) -> tuple[FloatArray, FloatArray]:
        """(sample times, rates) of `model`, oldest first (copies)."""
        q = self._samples.get(model)
        if q is None:
            return np.empty(0), np.empty(0)
        data = q.arrays_2d()
        return data[0], data[1]
