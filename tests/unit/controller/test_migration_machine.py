"""The transition table of migrations: complete, closed at the end, and enforced."""

from __future__ import annotations

import pytest

from gearshift.controller.migration_machine import (
    TERMINAL_PHASES,
    TRANSITIONS,
    IllegalTransition,
    MigrationKind,
    MigrationPhase,
    TrialOutcome,
    check_transition,
)

P = MigrationPhase


def test_every_active_phase_can_roll_back_and_no_end_can_be_left() -> None:
    for phase in P:
        exits = {b for a, b in TRANSITIONS if a is phase}
        if phase in TERMINAL_PHASES:
            assert exits == set(), phase
        elif phase is not P.ROLLING_BACK:
            assert P.ROLLING_BACK in exits, phase
    reachable = {P.PENDING} | {b for _a, b in TRANSITIONS}
    assert reachable == set(P)


@pytest.mark.parametrize(("before", "after"), [(P.PENDING, P.CANARY), (P.DONE, P.ROLLING_BACK),
                                               (P.CANARY, P.CANARY), (P.ROLLED_BACK, P.DONE)])
def test_transitions_outside_the_table_are_refused(before: P, after: P) -> None:
    with pytest.raises(IllegalTransition, match=f"m-1: illegal transition {before.value} -> "
                                                f"{after.value}"):
        check_transition("m-1", MigrationKind.ENGINE_SWITCH, None, before, after)


def test_rollback_ends_done_only_for_a_measured_trial() -> None:
    check_transition("m-1", MigrationKind.TRIAL, TrialOutcome.MEASURED, P.ROLLING_BACK, P.DONE)
    for kind, outcome in ((MigrationKind.TRIAL, TrialOutcome.FAILED),
                          (MigrationKind.TRIAL, None),
                          (MigrationKind.ENGINE_SWITCH, TrialOutcome.MEASURED)):
        with pytest.raises(IllegalTransition):
            check_transition("m-1", kind, outcome, P.ROLLING_BACK, P.DONE)
