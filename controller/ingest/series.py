"""One path for a report into a decision: a term's request-rate series and what feeds it.

`RateSeries` is the one owner of what the policy loop reads of the traffic:

- it is seeded from the stored per-minute rollups when its term opens (`RateSeries.open`),
  so a restarted controller, or one that takes over the lead, keeps its memory;
- it is fed by reports: each report is folded into its minute's rollup (`report`), and the
  fleet's live rates (each deployment's latest report) are sampled into the history once
  per resolution step (`sample`);
- each minute that completes (`tick`, from the controller's housekeeping; `close` at
  shutdown) goes, in one place, to the store, to the term's capacity learner and to the
  SLA metrics.

The rollup aggregator outlives a term (a minute open when the lead changes keeps its
reports), so the controller builds it once and hands it to each term's series; the
history, the learner and their writer are the term's.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Protocol

from gearshift.controller.ingest.fleet import FleetState, HostEntry
from gearshift.controller.ingest.rate_history import RateHistory
from gearshift.controller.ingest.rollup import RollupAggregator, to_rows_in_slices
from gearshift.controller.store.database import Store
from gearshift.controller.store.tables import RollupRow
from gearshift.v1 import agent_pb2


class RollupSink(Protocol):
    """Where completed minutes are stored (the batching writer)."""

    def submit_rollups(self, rows: list[RollupRow]) -> object: ...


class Learner(Protocol):
    """What learns from completed minutes (the term's capacity learner)."""

    def observe(self, rows: Sequence[RollupRow]) -> object: ...


class RollupMetrics(Protocol):
    """What exports the latest completed minute (the SLA gauges)."""

    def observe_rollups(self, rows: Sequence[RollupRow]) -> None: ...


class RateSeries:
    """A term's request-rate series, seeded from rollups and fed by reports, feeding the
    learner (see the module docstring)."""

    def __init__(self, history: RateHistory, fleet: FleetState, rollups: RollupAggregator, *,
                 sink: RollupSink, learner: Learner, metrics: RollupMetrics) -> None:
        self.history = history
        self._fleet = fleet
        self._rollups = rollups
        self._sink = sink
        self._learner = learner
        self._metrics = metrics

    @classmethod
    def open(cls, store: Store, fleet: FleetState, rollups: RollupAggregator, *,
             resolution_s: float, now: float, sink: RollupSink, learner: Learner,
             metrics: RollupMetrics) -> RateSeries:
        """A series seeded from the rollups stored within the history's retention
        (blocking: off the event loop)."""
        history = RateHistory(resolution_s)
        since = datetime.fromtimestamp(now - history.retention_s, UTC)
        per_minute: dict[str, dict[float, float]] = {}
        for r in store.rollups(since=since):
            ts = r.minute.timestamp() + 60.0  # a minute's mean is known at its end
            bucket = per_minute.setdefault(r.model, {})
            bucket[ts] = bucket.get(ts, 0.0) + r.request_rate_mean  # summed over engines
        history.extend_many({model: (sorted(points), [points[t] for t in sorted(points)])
                             for model, points in per_minute.items()})
        return cls(history, fleet, rollups, sink=sink, learner=learner, metrics=metrics)

    # -- fed by reports (on the event loop) ---------------------------------------------

    def report(self, host_id: str, entry: HostEntry, report: agent_pb2.Report,
               ts: float) -> None:
        """Fold a host's report, taken at `ts`, into its minute's rollups."""
        add = self._rollups.add
        gpu_model = entry.gpu_model
        for dep in report.deployments:
            add(host_id, dep, ts, gpu_model)

    def sample(self, now: float) -> None:
        """The fleet's live rates (each deployment's latest report), once per step."""
        if self.history.due(now):
            self.history.sample(now, self._fleet.model_rates())

    async def tick(self, now: float) -> list[RollupRow]:
        """Hand on the minutes complete at `now` (built in slices, between reports: see
        `to_rows_in_slices`); returns their rows."""
        popped = self._rollups.pop_completed(now)
        rows = await to_rows_in_slices(popped) if popped else []
        self._completed(rows)
        return rows

    def close(self) -> list[RollupRow]:
        """Hand on every open minute, complete or not (shutdown); returns their rows."""
        rows = self._rollups.flush_all()
        self._completed(rows)
        return rows

    def _completed(self, rows: list[RollupRow]) -> None:
        if rows:
            self._sink.submit_rollups(rows)
            self._learner.observe(rows)  # its snapshot is stored by housekeeping
            self._metrics.observe_rollups(rows)
