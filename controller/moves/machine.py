"""The migration state machine as data: phases, kinds, trial outcomes and the table of
allowed transitions (docs/migrations.md draws the same table as a diagram).

Every transition the orchestrator persists goes through `check_transition` first;
a transition that is not in `TRANSITIONS`, or whose condition does not hold for
the move, raises `IllegalTransition` (an internal error: a bug in a step function,
never something a user or an agent can cause) and nothing is saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from gearshift.common.errors import GearshiftError


class MigrationPhase(StrEnum):
    """Where one move is (docs/migrations.md)."""

    PENDING = "pending"  # created; placing the target replicas (waits here for capacity)
    PULLING = "pulling"  # the target hosts pull the target engine's image (containers only)
    BUILDING = "building"  # engine build on the target hosts (engines with a build step only)
    STARTING = "starting"  # target replicas started; waiting until the agents report them ready
    WARMING = "warming"  # targets ready, taking no traffic yet, watched for a few intervals
    CANARY = "canary"  # target takes canary_steps[canary_step] of the traffic, under analysis
    PROMOTING = "promoting"  # target takes all traffic for one interval, still watched
    DRAINING = "draining"  # sources leave the routes, drain and stop (late replicas start)
    DONE = "done"  # the model serves on the target only (a trial: it measured what it came for)
    ROLLING_BACK = "rolling_back"  # all traffic back to the source; targets drained and stopped
    ROLLED_BACK = "rolled_back"  # the rollback finished; `reason` says why it happened
    ABORTED = "aborted"  # a person aborted the move; it was rolled back first

    @property
    def active(self) -> bool:
        return self not in TERMINAL_PHASES


TERMINAL_PHASES = frozenset({MigrationPhase.DONE, MigrationPhase.ROLLED_BACK,
                             MigrationPhase.ABORTED})


class MigrationKind(StrEnum):
    """What a move is for."""

    ENGINE_SWITCH = "engine_switch"  # the model moves to another engine
    REVISION_ROLLOUT = "revision_rollout"  # new weights on the same engine
    TRIAL = "trial"  # the other engine serves a bounded share to be measured; the source stays


class TrialOutcome(StrEnum):
    """How a trial ended (set on trials only, when they end)."""

    MEASURED = "measured"  # the target served its share within the SLA for the whole analysis
    FAILED = "failed"  # the target failed its checks or broke: the measurement is a failure
    ABORTED = "aborted"  # a person aborted it: nothing was concluded


P = MigrationPhase


@dataclass(frozen=True)
class Transition:
    """One allowed edge: when the orchestrator takes it and what must hold."""

    when: str  # what makes the orchestrator take it (documentation and error messages)
    trial_measured_only: bool = False  # only a trial whose outcome is `measured`


_FAIL = "a step failed (target broke, timed out, canary failed its checks) or a person aborted"

TRANSITIONS: dict[tuple[MigrationPhase, MigrationPhase], Transition] = {
    (P.PENDING, P.PULLING): Transition(
        "targets placed; the target engine runs from an image on a target host"),
    (P.PULLING, P.BUILDING): Transition("the image is on every target host; the engine "
                                        "needs a build"),
    (P.PULLING, P.STARTING): Transition("the image is on every target host"),
    (P.PULLING, P.ROLLING_BACK): Transition(_FAIL),
    (P.PENDING, P.BUILDING): Transition("targets placed; the target engine needs a build"),
    (P.PENDING, P.STARTING): Transition("targets placed"),
    (P.PENDING, P.ROLLING_BACK): Transition(_FAIL),
    (P.BUILDING, P.STARTING): Transition("the engine is built on every target host"),
    (P.BUILDING, P.ROLLING_BACK): Transition(_FAIL),
    (P.STARTING, P.WARMING): Transition("every early target replica is ready"),
    (P.STARTING, P.ROLLING_BACK): Transition(_FAIL),
    (P.WARMING, P.CANARY): Transition("the targets stayed healthy for the warm intervals"),
    (P.WARMING, P.ROLLING_BACK): Transition(_FAIL),
    (P.CANARY, P.PROMOTING): Transition("the last canary step passed its analysis"),
    (P.CANARY, P.ROLLING_BACK): Transition(
        _FAIL + "; a trial: its last step passed (it always returns to the source)"),
    (P.PROMOTING, P.DRAINING): Transition("the target served all traffic for one interval"),
    (P.PROMOTING, P.ROLLING_BACK): Transition(_FAIL),
    (P.DRAINING, P.DONE): Transition("every source is stopped and every late target ready"),
    (P.DRAINING, P.ROLLING_BACK): Transition("a target disappeared, or a person aborted"),
    (P.ROLLING_BACK, P.ROLLED_BACK): Transition("targets stopped, sources serve again"),
    (P.ROLLING_BACK, P.ABORTED): Transition("as rolled_back, after a person's abort"),
    (P.ROLLING_BACK, P.DONE): Transition("a trial that measured its target is back on the source",
                                         trial_measured_only=True),
}


class IllegalTransition(GearshiftError):
    """The orchestrator tried a transition the table does not allow (a bug, never input)."""


def check_transition(migration_id: str, kind: MigrationKind, outcome: TrialOutcome | None,
                     before: MigrationPhase, after: MigrationPhase) -> Transition:
    """The table's entry for `before -> after`; IllegalTransition when there is none or
    its condition does not hold for this move."""
    edge = TRANSITIONS.get((before, after))
    if edge is None:
        allowed = sorted(b.value for a, b in TRANSITIONS if a is before)
        raise IllegalTransition(
            f"migration {migration_id}: illegal transition {before.value} -> {after.value}; "
            f"from {before.value} only {', '.join(allowed) or 'nothing (it has ended)'}")
    if edge.trial_measured_only and (kind is not MigrationKind.TRIAL
                                     or outcome is not TrialOutcome.MEASURED):
        raise IllegalTransition(
            f"migration {migration_id}: illegal transition {before.value} -> {after.value} for a "
            f"{kind.value} (trial outcome {outcome.value if outcome else 'none'}); only a trial "
            "that measured its target ends done after rolling back")
    return edge


__all__ = ["TERMINAL_PHASES", "TRANSITIONS", "IllegalTransition", "MigrationKind",
           "MigrationPhase", "Transition", "TrialOutcome", "check_transition"]
