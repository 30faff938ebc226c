"""Why a governed model got no decision: the reason the core stopped at, as data.

The core (`policies.core`) knows at each early return why it made no move; it returns
that reason as a `NoDecisionReason` member (no allocation, so the fleet's tick stays
cheap) and writes the words (`NoDecision.detail`: how much history of how much, the
cooldown's end, the rules' own reasons) only when asked: by `gearshift decisions
evaluate` (EvaluateNow) and when the live loop logs a model whose reason changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from gearshift.policies.loader import Policy

MINUTE_S = 60.0
HOUR_S = 3600.0


class NoDecisionReason(StrEnum):
    NOT_SELECTED = "not_selected"  # outside the policy's selector
    NO_READY_DEPLOYMENT = "no_ready_deployment"  # no ready deployment on any host (live loop)
    PAUSED = "paused"  # automation paused fleet-wide (`gearshift pause`)
    FROZEN = "frozen"  # an operator's or the policy's freeze
    MIGRATING = "migrating"  # a move is in flight; the core leaves the model alone
    PINNED = "pinned"  # pinned to the engine it is on
    INSUFFICIENT_HISTORY = "insufficient_history"  # less than `signals.minHistory` of traffic
    NO_ENGINE_AVAILABLE = "no_engine_available"  # every other engine refused, no rule holds
    NO_RULE_FIRED = "no_rule_fired"  # no rule had an opinion (or wanted a refused engine)
    CURRENT_IS_BEST = "current_is_best"  # the deciding rule keeps the current engine
    WITHIN_HYSTERESIS = "within_hysteresis"  # expected-savings: net savings under the margin
    MIN_DWELL = "min_dwell"  # on its engine for less than `guardrails.minDwell`
    COOLDOWN = "cooldown"  # a switch less than `guardrails.cooldown` ago
    WINDOW_CLOSED = "window_closed"  # outside every maintenance window
    OVER_BUDGET = "over_budget"  # `maxConcurrentMigrations` taken by other moves
    ALREADY_DECIDED = "already_decided"  # the same move is already decided and open (live loop)


@dataclass(frozen=True)
class NoDecision:
    """One model's reason for no decision, with its words and, for a guardrail that
    ends, when it ends (epoch seconds)."""

    model: str
    reason: NoDecisionReason
    detail: str  # starts with the reason in words: "insufficient history (12 min of 1 h minHistory)"
    until: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "reason": self.reason.value, "detail": self.detail,
                "until": None if self.until is None else _iso(self.until)}


def duration(seconds: float) -> str:
    """A span in the largest unit that reads well: "12 min", "1 h", "1.5 h", "2 d"."""
    if seconds < HOUR_S:
        return f"{seconds / MINUTE_S:.0f} min"
    if seconds < 48 * HOUR_S:
        return f"{round(seconds / HOUR_S, 1):g} h"
    return f"{round(seconds / (24 * HOUR_S), 1):g} d"


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def insufficient_history(history_s: float, min_history_s: float) -> str:
    return f"insufficient history ({duration(history_s)} of {duration(min_history_s)} minHistory)"


def next_window_opens(policy: Policy, now: float) -> float | None:
    """When the next maintenance window opens after `now` (None: no windows)."""
    at = datetime.fromtimestamp(now, UTC)
    opens = [t for trigger, _ in policy.windows
             if (t := trigger.get_next_fire_time(None, at + timedelta(microseconds=1))) is not None]
    return min(opens).timestamp() if opens else None


def guardrail_hold(policy: Policy, reason: NoDecisionReason, engine: str, since: float,
                   last_switch: float | None, now: float) -> tuple[str, float | None]:
    """The words and end of a guardrail that held a move (`reason`: MIN_DWELL, COOLDOWN or
    WINDOW_CLOSED)."""
    g = policy.doc.spec.guardrails
    if reason is NoDecisionReason.MIN_DWELL:
        until = since + g.min_dwell
        return (f"minimum dwell until {_iso(until)} (on {engine} for {duration(now - since)} of "
                f"{duration(g.min_dwell)} minDwell)", until)
    if reason is NoDecisionReason.COOLDOWN:
        assert last_switch is not None
        until = last_switch + g.cooldown
        return (f"cooldown until {_iso(until)} (last switch {duration(now - last_switch)} ago, "
                f"cooldown {duration(g.cooldown)})", until)
    opens = next_window_opens(policy, now)
    return ("outside every maintenance window"
            + (f" (the next opens at {_iso(opens)})" if opens is not None else ""), opens)


__all__ = ["NoDecision", "NoDecisionReason", "duration", "guardrail_hold",
           "insufficient_history", "next_window_opens"]
