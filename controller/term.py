"""One election term's acting parts, built together by `open_term` and ended by one call.

A term owns what a leading controller acts with: the rate series (seeded from the
stored rollups, fed by reports, feeding the learner: `controller.ingest.series`), the
capacity learner (loaded from the store), the forecaster (its worker
thread), the decision store, the policy versions, the decisions' review, the migration orchestrator and the
policy loop. Each is built with its collaborators and never rewired: a new term builds
new ones from the store, since another controller may have led meanwhile. Before the
first election the controller holds a term of epoch 0, which serves reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gearshift.controller.config import ControllerConfig
from gearshift.controller.decisions.learning import CapacityLearner, Forecaster
from gearshift.controller.decisions.policy_loop import PolicyLoop
from gearshift.controller.decisions.review import DecisionReview
from gearshift.controller.decisions.store import DecisionStore
from gearshift.controller.decisions.versions import PolicyVersions
from gearshift.controller.ingest.fleet import FleetState
from gearshift.controller.ingest.rate_history import RateHistory
from gearshift.controller.ingest.rollup import RollupAggregator
from gearshift.controller.ingest.series import RateSeries, RollupSink
from gearshift.controller.metrics import ControllerMetrics
from gearshift.controller.moves.orchestrator import (
    MigrationOrchestrator,
    OrchestratorSettings,
    SendCommand,
)
from gearshift.controller.moves.store import MigrationRepository
from gearshift.controller.store.database import Store
from gearshift.policies.loader import Policy

# Hosts seen within RECENT_HOST_S before a term began are waited for (their first report)
# before gateways get the term's routing table (`ControlService.WatchRoutes`).
RECENT_HOST_S = 600.0


@dataclass(frozen=True)
class LeaderTerm:
    """The parts one term acts with (see the module docstring)."""

    epoch: int
    fleet: FleetState
    series: RateSeries
    learner: CapacityLearner
    forecaster: Forecaster
    decisions: DecisionStore
    policies: PolicyVersions
    review: DecisionReview
    orchestrator: MigrationOrchestrator
    policy_loop: PolicyLoop
    expected_hosts: frozenset[str]  # hosts seen within RECENT_HOST_S before it began

    @property
    def history(self) -> RateHistory:
        """The rate history the policy loop and the forecaster read (the series')."""
        return self.series.history

    def end(self) -> None:
        """Release what the term holds beyond memory: the forecaster's worker thread."""
        self.forecaster.close()


def open_term(*, epoch: int, config: ControllerConfig, store: Store, fleet: FleetState,
              rollups: RollupAggregator, rollup_sink: RollupSink,
              metrics: ControllerMetrics, paused: Callable[[], bool],
              send_command: SendCommand, prepare: Callable[[Policy], object],
              on_policy_change: Callable[[Policy], None],
              clock: Callable[[], float]) -> LeaderTerm:
    """A term's parts, read afresh from the store (blocking: off the event loop)."""
    learner = CapacityLearner(store)
    learner.load()
    series = RateSeries.open(store, fleet, rollups, resolution_s=config.history_resolution_s,
                             now=clock(), sink=rollup_sink, learner=learner, metrics=metrics)
    history = series.history
    decisions = DecisionStore(store.engine)
    policies = PolicyVersions(store, decisions, fleet, gpu_price_per_hour=config.gpu_price_per_hour,
                              prepare=prepare, on_change=on_policy_change)
    migrations = MigrationRepository(store.engine)
    orchestrator = MigrationOrchestrator(
        migrations, fleet, send_command, epoch=epoch,
        settings=OrchestratorSettings(
            canary_steps=config.canary_steps, analysis_intervals=config.analysis_intervals,
            sla_for=policies.sla_for),
        on_transition=metrics.migration_transition, on_created=metrics.migration_created)
    orchestrator.install()
    review = DecisionReview(decisions, migrations, orchestrator=orchestrator,
                            on_status=metrics.decision)
    # Forecasts are fitted on a worker thread: a tick only reads them (controller.decisions.learning).
    forecaster = Forecaster(history.arrays, config.history_resolution_s, background=True)
    loop = PolicyLoop(store, decisions, fleet, history, paused=paused, clock=clock, policies=policies,
                      review=review, learner=learner, forecaster=forecaster,
                      gpu_price_per_hour=config.gpu_price_per_hour)
    recent = clock() - RECENT_HOST_S
    expected = frozenset(h.host_id for h in store.list_hosts()
                         if h.last_seen.timestamp() >= recent)
    return LeaderTerm(epoch=epoch, fleet=fleet, series=series, learner=learner,
                      forecaster=forecaster, decisions=decisions, policies=policies, review=review,
                      orchestrator=orchestrator, policy_loop=loop, expected_hosts=expected)
