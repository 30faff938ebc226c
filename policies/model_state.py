"""Where a model stands, computed the same way live and in the backtest.

The decision core reads a `core.ModelState` per model: the engine it is on, since
when, the decision time of the last switch that counts for the cooldown, a move
in flight, and the engines already trialled. The live loop
(`controller.policy_loop`) and the backtest (`policies.backtest`) observe
different things (replicas reported by agents and stored migrations; the cost
model's replay), and both turn them into that state through the functions here,
so the rules for "which engine is current", "how long has it been there", "what
counts as a switch" and "does this move need a trial" exist once.

Engine names are strings of the engine catalog; nothing here branches on one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from gearshift.policies.schema import Trials

MEASURED_SOURCE = "measured"  # the capacity source that makes a trial unnecessary


def current_engine(replicas: Mapping[str, int], *, moving_from: str | None = None,
                   previous: str | None = None) -> str | None:
    """The engine a model is on, from its serving replicas per engine.

    A move in flight keeps the model on the engine it leaves (`moving_from`) until
    it ends. Otherwise the engine with the most replicas; on a tie the engine it
    was on before (`previous`), then the first name in order, so a restart or a
    replica count that wobbles never flips the answer by itself. None: no replica.
    """
    if moving_from is not None:
        return moving_from
    if len(replicas) == 1:  # most models: one engine (no tie to break)
        for e, n in replicas.items():
            return e if n > 0 else None
    serving = {e: n for e, n in replicas.items() if n > 0}
    if not serving:
        return None
    most = max(serving.values())
    tied = sorted(e for e, n in serving.items() if n == most)
    return previous if previous in tied else tied[0]


@dataclass(frozen=True)
class Tenure:
    """The engine a model is on and since when (epoch seconds); stored live, so that a
    restarted controller keeps the dwell time."""

    engine: str
    since: float


def advance_tenure(tenure: Tenure | None, engine: str, now: float, *,
                   first_seen: float) -> Tenure:
    """The tenure after observing the model on `engine` at `now`.

    Unchanged while the engine is the same; a change starts a new tenure at `now`.
    A model seen for the first time has been on its engine since `first_seen` (the
    backtest: long before the trace; live: the first report of it).
    """
    if tenure is None:
        return Tenure(engine, min(first_seen, now))
    if tenure.engine == engine:
        return tenure
    return Tenure(engine, now)


class SwitchOutcome(StrEnum):
    """What became of a decided move, for the cooldown."""

    IN_FLIGHT = "in_flight"  # accepted, not finished yet
    DONE = "done"  # the model moved
    ROLLED_BACK = "rolled_back"  # tried and undone (failed checks or a person's abort)
    TRIAL = "trial"  # a bounded trial of the target that returned to the source


# A move that was rolled back counts as a switch: it cost a build and a canary, and
# trying again at once would repeat it. A trial is a measurement, not a switch.
COUNTS_FOR_COOLDOWN = frozenset({SwitchOutcome.IN_FLIGHT, SwitchOutcome.DONE,
                                 SwitchOutcome.ROLLED_BACK})


@dataclass(frozen=True)
class SwitchRecord:
    decided_at: float  # epoch seconds of the decision
    outcome: SwitchOutcome


def last_switch(records: Iterable[SwitchRecord]) -> float | None:
    """Decision time of the latest move that counts for the cooldown (None: none)."""
    times = [r.decided_at for r in records if r.outcome in COUNTS_FOR_COOLDOWN]
    return max(times) if times else None


def release_key(engine: str, version: str) -> str:
    """What a trial of `engine`'s release `version` is remembered by in `trialled`."""
    return f"{engine}@{version}"


def trial_share(trials: Trials, target: str, capacity_source: object,
                trialled: Iterable[str]) -> float | None:
    """The share of traffic a move to `target` first tries the target on, or None when
    the move goes ahead at once: trials are off, the target's capacity for the model
    was measured, or the target was trialled already (its result is in the facts)."""
    if not trials.enabled or capacity_source == MEASURED_SOURCE or target in set(trialled):
        return None
    return trials.share


__all__ = ["COUNTS_FOR_COOLDOWN", "MEASURED_SOURCE", "SwitchOutcome", "SwitchRecord", "Tenure",
           "advance_tenure", "current_engine", "last_switch", "release_key", "trial_share"]
