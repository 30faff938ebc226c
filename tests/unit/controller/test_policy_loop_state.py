"""The live path through the shared model-state rules, and decision status reconciled
from migration rows: a real store, a real fleet state, the policy loop's public calls."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gearshift.common.errors import FailedPrecondition
from gearshift.controller.decisions.policy_loop import PolicyLoop, RateHistory
from gearshift.controller.decisions.review import DecisionReview
from gearshift.controller.decisions.store import DecisionStore
from gearshift.controller.ingest.fleet import FleetState
from gearshift.controller.metrics import ControllerMetrics
from gearshift.controller.moves.machine import MigrationKind, MigrationPhase, TrialOutcome
from gearshift.controller.moves.store import MigrationRepository, MigrationRow
from gearshift.controller.store.database import Store, default_sqlite_url
from gearshift.controller.store.tables import DecisionRow
from gearshift.policies.core import DecisionStatus
from gearshift.v1 import agent_pb2

NOW = 1_773_014_400.0  # 2026-03-09T00:00:00Z
HOUR_S = 3600.0


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(default_sqlite_url(tmp_path / "data"))
    yield s
    s.close()


def _fleet(now: float, engines: dict[str, int]) -> FleetState:
    """A controller's view at `now`: model m with `engines[e]` ready replicas on e."""
    fleet = FleetState(clock=lambda: now)
    fleet.hello(agent_pb2.Hello(host_id="h1", protocol_version=agent_pb2.PROTOCOL_VERSION_1,
                                gpus=[agent_pb2.GpuInfo(index=i) for i in range(8)]), 1.0)
    report = agent_pb2.Report(seq=1)
    for engine, n in engines.items():
        for i in range(n):
            report.deployments.add(deployment_id=f"{engine}-{i}", model="m", engine=engine,
                                   phase=agent_pb2.DEPLOYMENT_PHASE_READY)
    fleet.report("h1", report)
    return fleet


def _loop(store: Store, now: float, engines: dict[str, int],
          on_decision: Callable[[str, DecisionStatus], None] | None = None) -> PolicyLoop:
    decisions = DecisionStore(store.engine)
    review = DecisionReview(decisions, MigrationRepository(store.engine), on_status=on_decision)
    return PolicyLoop(store, decisions, _fleet(now, engines), RateHistory(60.0),
                      paused=lambda: False, clock=lambda: now, review=review)


def _decision(store: Store, status: DecisionStatus, at: float, **overrides: object) -> DecisionRow:
    fields: dict[str, object] = {"created_at": datetime.fromtimestamp(at, UTC), "model": "m",
                                 "from_engine": "vllm", "to_engine": "tensorrt-llm", "rule": "r",
                                 "mode": "auto", "status": status, **overrides}
    row = DecisionRow(**fields)  # type: ignore[arg-type]
    DecisionStore(store.engine).add_decision(row)
    return row


def _migration(loop: PolicyLoop, decision_id: str, phase: MigrationPhase, **overrides: object
               ) -> MigrationRow:
    fields: dict[str, object] = {"decision_id": decision_id, "model": "m", "from_engine": "vllm",
                                 "to_engine": "tensorrt-llm", "phase": phase, **overrides}
    row = MigrationRow(**fields)  # type: ignore[arg-type]
    loop.migrations.add(row, "created by the test")
    return row


def test_time_on_the_engine_survives_a_restart_and_restarts_on_a_change(store: Store) -> None:
    first = _loop(store, NOW, {"vllm": 1}).model_state("m", NOW)
    assert first is not None and (first.engine, first.since) == ("vllm", NOW)
    # A controller started 5 h later (new fleet state, new loop) keeps the dwell.
    later = _loop(store, NOW + 5 * HOUR_S, {"vllm": 1}).model_state("m", NOW + 5 * HOUR_S)
    assert later is not None and (later.engine, later.since) == ("vllm", NOW)
    # Majority by replicas; a tie keeps the engine it was on.
    tie = _loop(store, NOW + 6 * HOUR_S, {"vllm": 1, "tensorrt-llm": 1}).model_state(
        "m", NOW + 6 * HOUR_S)
    assert tie is not None and tie.engine == "vllm"
    moved = _loop(store, NOW + 7 * HOUR_S, {"tensorrt-llm": 2, "vllm": 1}).model_state(
        "m", NOW + 7 * HOUR_S)
    assert moved is not None and (moved.engine, moved.since) == ("tensorrt-llm", NOW + 7 * HOUR_S)


def test_cooldown_counts_rollbacks_and_not_trials(store: Store) -> None:
    loop = _loop(store, NOW, {"vllm": 1})
    _decision(store, DecisionStatus.DONE, NOW - 9 * HOUR_S)
    _decision(store, DecisionStatus.ROLLED_BACK, NOW - 5 * HOUR_S)
    _decision(store, DecisionStatus.SUPERSEDED, NOW - 2 * HOUR_S, trial_share=0.1)
    _decision(store, DecisionStatus.REJECTED, NOW - 1 * HOUR_S)
    state = loop.model_state("m", NOW)
    assert state is not None and state.last_switch == NOW - 5 * HOUR_S


def test_a_moving_model_stays_on_its_source_and_ended_trials_count_as_trialled(
        store: Store) -> None:
    loop = _loop(store, NOW, {"tensorrt-llm": 1, "vllm": 1})
    trial = _decision(store, DecisionStatus.SUPERSEDED, NOW - HOUR_S, trial_share=0.1)
    _migration(loop, trial.id, MigrationPhase.DONE, kind=MigrationKind.TRIAL,
               trial_outcome=TrialOutcome.MEASURED, to_engine="sglang")
    move = _decision(store, DecisionStatus.EXECUTING, NOW)
    _migration(loop, move.id, MigrationPhase.CANARY)
    state = loop.model_state("m", NOW)
    assert state is not None
    assert (state.engine, state.migrating_to, state.trialled) == (
        "vllm", "tensorrt-llm", frozenset({"sglang"}))


@pytest.mark.parametrize(("phase", "kind", "outcome", "status", "words"), [
    (MigrationPhase.DONE, MigrationKind.ENGINE_SWITCH, None, DecisionStatus.DONE, "done"),
    (MigrationPhase.ROLLED_BACK, MigrationKind.ENGINE_SWITCH, None, DecisionStatus.ROLLED_BACK,
     "rolled back: canary failed"),
    (MigrationPhase.ABORTED, MigrationKind.ENGINE_SWITCH, None, DecisionStatus.ROLLED_BACK,
     "aborted: canary failed"),
    (MigrationPhase.DONE, MigrationKind.TRIAL, TrialOutcome.MEASURED, DecisionStatus.SUPERSEDED,
     "measured"),
])
def test_an_ended_migration_settles_its_executing_decision(
        store: Store, phase: MigrationPhase, kind: MigrationKind, outcome: TrialOutcome | None,
        status: DecisionStatus, words: str) -> None:
    loop = _loop(store, NOW, {"vllm": 1})
    d = _decision(store, DecisionStatus.EXECUTING, NOW)
    _migration(loop, d.id, phase, kind=kind, trial_outcome=outcome, reason="canary failed")
    assert loop.review.reconcile() == 1
    row = loop.decisions.get_decision(d.id)
    assert row is not None and row.status is status and words in row.status_reason
    assert loop.review.reconcile() == 0  # level-triggered: nothing left to do


def test_an_approved_decision_whose_migration_started_becomes_executing(store: Store) -> None:
    loop = _loop(store, NOW, {"vllm": 1})
    d = _decision(store, DecisionStatus.APPROVED, NOW)
    mig = _migration(loop, d.id, MigrationPhase.WARMING)
    loop.review.reconcile()
    row = loop.decisions.get_decision(d.id)
    assert row is not None and row.status is DecisionStatus.EXECUTING and mig.id in row.status_reason


def test_decision_metrics_count_each_status_entered_by_rule(store: Store) -> None:
    metrics = ControllerMetrics()
    loop = _loop(store, NOW, {"vllm": 1}, on_decision=metrics.decision)

    def count(rule: str, outcome: str) -> float | None:
        return metrics.registry.get_sample_value("gearshift_controller_decisions_total",
                                                 {"rule": rule, "outcome": outcome})

    moving = _decision(store, DecisionStatus.EXECUTING, NOW, rule="prefer-trt")
    _migration(loop, moving.id, MigrationPhase.ROLLED_BACK, reason="canary failed")
    proposed = _decision(store, DecisionStatus.PROPOSED, NOW, rule="cheaper", mode="approve")
    loop.review.reconcile()
    loop.review.reconcile()  # nothing changes: nothing counted
    assert count("prefer-trt", "rolled_back") == 1
    loop.review.reject(proposed.id, "not now", "ops")
    assert count("cheaper", "rejected") == 1
    with pytest.raises(FailedPrecondition, match="only a proposed decision"):
        loop.review.reject(proposed.id, "again", "ops")  # refused: not counted again
    assert count("cheaper", "rejected") == 1
    assert count("prefer-trt", "done") is None and count("cheaper", "approved") is None
