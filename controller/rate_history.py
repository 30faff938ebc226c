"""Per-model request-rate samples in memory, at a fixed resolution, for the policy.

`RateHistory` is what the policy loop's signals and forecasts read; it is bounded
(`HISTORY_RETENTION_S`) and a restarted controller seeds it from the stored
per-minute rollups.
"""

from __future__ import annotations

from collections import deque
from datetime import UTC, datetime

from gearshift.controller.store import Store

HISTORY_RETENTION_S = 8 * 24 * 3600.0


class RateHistory:
    """Per-model request-rate samples at a fixed resolution, in memory and bounded."""

    def __init__(self, resolution_s: float, retention_s: float = HISTORY_RETENTION_S) -> None:
        self.resolution_s = resolution_s
        self._max = max(10, int(retention_s / resolution_s))
        self._samples: dict[str, deque[tuple[float, float]]] = {}
        self._last_sample = 0.0

    def due(self, now: float) -> bool:
        return now - self._last_sample >= self.resolution_s * 0.999

    def sample(self, now: float, rates: dict[str, float]) -> None:
        self._last_sample = now
        for model, rps in rates.items():
            q = self._samples.setdefault(model, deque(maxlen=self._max))
            if q and now - q[-1][0] < self.resolution_s * 0.5:
                continue
            q.append((now, rps))

    def seed(self, store: Store, now: float) -> None:
        """Start from the stored per-minute rollups (a restarted controller keeps its memory)."""
        since = datetime.fromtimestamp(now - self._max * self.resolution_s, UTC)
        per_minute: dict[str, dict[float, float]] = {}
        for r in store.rollups(since=since):
            ts = r.minute.timestamp() + 60.0
            bucket = per_minute.setdefault(r.model, {})
            bucket[ts] = bucket.get(ts, 0.0) + r.request_rate_mean
        for model, points in per_minute.items():
            q = self._samples.setdefault(model, deque(maxlen=self._max))
            for ts in sorted(points):
                q.append((ts, points[ts]))

    def models(self) -> list[str]:
        return sorted(self._samples)

    def arrays(self, model: str) -> tuple[list[float], list[float]]:
        q = self._samples.get(model, deque())
        return [t for t, _ in q], [r for _, r in q]
