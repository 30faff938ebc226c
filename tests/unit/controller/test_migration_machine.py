"""The transition table of migrations: complete, closed at the end, and enforced."""

from __future__ import annotations

from pathlib import Path

import pytest

from gearshift.controller.moves.machine import (
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


def test_the_documented_table_is_the_code_table() -> None:
    doc = (Path(__file__).parents[3] / "docs" / "migrations.md").read_text()
    rows = {tuple(cell.strip(" `") for cell in line.split("|")[1:3])
            for line in doc.splitlines() if line.startswith("| `")
            and line.count("|") == 4 and "`" in line.split("|")[2]}
    assert rows == {(a.value, b.value) for a, b in TRANSITIONS}
    diagram = {tuple(line.strip().split(" --> ")) for line in doc.splitlines()
               if " --> " in line and "[*]" not in line}
    assert diagram == {(a.value, b.value) for a, b in TRANSITIONS}
