"""Rule kinds, registered by name and checked when a policy loads.

A rule looks at one model's signals and says which engine it wants (possibly the
current one: "hold"), or has no opinion. The first rule with an opinion decides;
the decision core applies guardrails afterwards.

What a rule says of its outcome (its reason, the inputs it read, the tests it made:
a `WriteUp`) is written on first read: a tick asks the rules of every model of the
fleet, and only the moves it decides (with the rules they passed over) are written up.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gearshift.common.frozen_records import fast_init
from gearshift.policies.economics import NO_PRICE_NOTE, MoveEstimate
from gearshift.policies.schema import Condition, Rule
from gearshift.policies.signals import (
    SIGNALS,
    EngineFacts,
    SignalValue,
    SignalView,
    is_number,
    queue_share_of_ttft_sla,
)

OPERATORS = ("gt", "ge", "lt", "le", "eq", "ne", "in")
NUMBER_OPERATORS = frozenset({"gt", "ge", "lt", "le", "eq", "ne"})
EQUALITY_OPERATORS = frozenset({"eq", "ne"})
STRING_OPERATORS = frozenset({"eq", "ne", "in"})


@fast_init
@dataclass(frozen=True)
class RuleContext:
    view: SignalView
    candidates: Mapping[str, MoveEstimate | None]  # engines the model may move to
    order: tuple[str, ...]  # preference order, for ties
    price_known: bool = True  # a GPU price is known (else no move can be estimated)


@dataclass(frozen=True)
class ConditionResult:
    """One test a rule made, as data: `observed <operator> threshold` held or not.

    Threshold rules record their `when` / `whenAny` conditions; the built-in kinds
    record the test they make (savings over the margin, latency over the SLA), so
    a decision's explanation renders these rows, never the rule's prose.
    """

    signal: str
    operator: str  # one of OPERATORS
    threshold: SignalValue | tuple[str, ...]
    observed: SignalValue
    unit: str  # the signal's unit ("" when it has none)
    held: bool
    group: str = "when"  # "when", "whenAny" or "test" (a rule kind's built-in test)

    def to_dict(self, rule: str) -> dict[str, Any]:
        threshold = list(self.threshold) if isinstance(self.threshold, tuple) else self.threshold
        return {"rule": rule, "signal": self.signal, "operator": self.operator,
                "threshold": threshold, "observed": self.observed, "unit": self.unit,
                "held": self.held, "group": self.group}


@dataclass(frozen=True)
class WriteUp:
    """What a rule says of its outcome, as a decision stores it."""

    why: str  # the rule's own words
    inputs: dict[str, SignalValue] = field(default_factory=dict)
    conditions: tuple[ConditionResult, ...] = ()  # what the rule tested, with the values seen


@fast_init
@dataclass(frozen=True)
class RuleOutcome:
    target: str | None  # None: no opinion; the current engine: hold
    write: Callable[[], WriteUp]  # called once, on the first read of the write-up
    urgent: bool = False  # bypasses dwell, cooldown and maintenance windows
    estimate: MoveEstimate | None = None
    regression: str = ""  # the serving engine's release regressed (why the move is urgent)

    @functools.cached_property
    def write_up(self) -> WriteUp:
        return self.write()

    @property
    def why(self) -> str:
        return self.write_up.why

    @property
    def inputs(self) -> dict[str, SignalValue]:
        return self.write_up.inputs

    @property
    def conditions(self) -> tuple[ConditionResult, ...]:
        return self.write_up.conditions


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=False)


class NoParams(_Params):
    pass


# The SLA guard's saturation warning: queue time p99 at or above this share of the TTFT p99
# target. Waiting time grows without bound as load nears capacity (in an M/M/c queue the
# mean wait goes as rho / (1 - rho)) while prefill time stays flat, so the queue's share of
# the TTFT budget rises steeply just before TTFT breaks; at half the budget the engine is
# a few percent of load away from breaking it (bench/sla_queue_warning.py measures the lead
# on the emulator).
DEFAULT_QUEUE_SHARE_OF_TTFT_SLA = 0.5


class SlaGuardParams(_Params):
    """`queueShareOfTtftSla`: the saturation warning's threshold (null: no warning)."""

    queue_share_of_ttft_sla: float | None = Field(default=DEFAULT_QUEUE_SHARE_OF_TTFT_SLA, gt=0,
                                                  le=1, alias="queueShareOfTtftSla")


class SavingsParams(_Params):
    min_net_savings_usd: float = Field(default=0.0, ge=0, alias="minNetSavingsUsd")


@dataclass(frozen=True)
class RuleKind:
    help: str
    params: type[_Params]
    conditions: bool  # uses when / whenAny (required) or not (forbidden)
    prefer: bool  # needs `prefer` (required) or not (forbidden)
    evaluate: Callable[[Rule, Any, RuleContext], RuleOutcome]


def condition_operator(c: Condition) -> list[tuple[str, Any]]:
    """The (operator, operand) pairs set on a condition."""
    return [(op, getattr(c, "in_" if op == "in" else op)) for op in OPERATORS
            if getattr(c, "in_" if op == "in" else op) is not None]


def _holds(op: str, value: SignalValue, operand: Any) -> bool:
    if value is None:
        return False  # unknown never fires a rule
    if op == "in":
        return value in operand
    if op == "eq":
        return bool(value == operand)
    if op == "ne":
        return bool(value != operand)
    if not is_number(value):
        return False
    assert isinstance(value, int | float)
    return {"gt": value > operand, "ge": value >= operand,
            "lt": value < operand, "le": value <= operand}[op]


def _unit(signal: str) -> str:
    spec = SIGNALS.get(signal)
    return "" if spec is None else spec.unit


def _check(conds: list[Condition], view: SignalView, inputs: dict[str, SignalValue],
           group: str) -> list[tuple[Condition, ConditionResult]]:
    out = []
    for c in conds:
        value = SIGNALS[c.signal].read(view)
        inputs[c.signal] = value
        op, operand = condition_operator(c)[0]
        threshold = tuple(operand) if isinstance(operand, list) else operand
        out.append((c, ConditionResult(c.signal, op, threshold, value, _unit(c.signal),
                                       _holds(op, value, operand), group)))
    return out


def _describe(c: Condition, inputs: dict[str, SignalValue]) -> str:
    op, operand = condition_operator(c)[0]
    sym = {"gt": ">", "ge": ">=", "lt": "<", "le": "<=", "eq": "==", "ne": "!=", "in": "in"}[op]
    value = inputs.get(c.signal)
    shown = f"{value:.4g}" if is_number(value) else repr(value)
    return f"{c.signal}={shown} {sym} {operand!r}"


def _threshold(rule: Rule, _: NoParams, ctx: RuleContext) -> RuleOutcome:
    inputs: dict[str, SignalValue] = {}
    all_ok = _check(rule.when, ctx.view, inputs, "when")
    any_ok = _check(rule.when_any, ctx.view, inputs, "whenAny")
    tested = tuple(r for _, r in all_ok + any_ok)
    failed = [c for c, r in all_ok if not r.held]
    if failed or (any_ok and not any(r.held for _, r in any_ok)):
        return RuleOutcome(None, lambda: WriteUp(
            "not met: " + ", ".join(_describe(c, inputs) for c in failed) if failed
            else "none of whenAny met: " + ", ".join(_describe(c, inputs) for c, _ in any_ok),
            inputs, tested))
    met = [c for c, _ in all_ok] + [c for c, r in any_ok if r.held]
    return RuleOutcome(rule.prefer, lambda: WriteUp(
        "met: " + ", ".join(_describe(c, inputs) for c in met), inputs, tested),
        estimate=ctx.candidates.get(rule.prefer or ""))


def _static(rule: Rule, _: NoParams, ctx: RuleContext) -> RuleOutcome:
    return RuleOutcome(rule.prefer, lambda: WriteUp(f"always {rule.prefer}"),
                       estimate=ctx.candidates.get(rule.prefer or ""))


def _sla_guard(rule: Rule, params: SlaGuardParams, ctx: RuleContext) -> RuleOutcome:
    """A measured breach moves at once (urgent) to the engine that meets the SLA and saves
    most; without a breach, a queue that takes `queueShareOfTtftSla` of the TTFT budget
    (saturation coming) moves, within the guardrails, to an engine with more capacity per
    replica that meets the SLA."""
    view = ctx.view
    share = queue_share_of_ttft_sla(view.signals.facts, view.engine)
    ok = SIGNALS["sla_ok"].read(view)

    def inputs() -> dict[str, SignalValue]:
        facts = view.signals.facts
        ef = facts.engines.get(view.engine)
        out: dict[str, SignalValue] = {
            "ttft_p99_ms": None if ef is None else ef.ttft_p99_ms,
            "sla_ttft_p99_ms": facts.sla_ttft_p99_ms,
            "itl_p99_ms": None if ef is None else ef.itl_p99_ms,
            "sla_itl_p99_ms": facts.sla_itl_p99_ms,
        }
        if share is not None:
            out["queue_p99_ms"] = None if ef is None else ef.queue_p99_ms
            out["queue_share_of_ttft_sla"] = share
        out["sla_ok"] = ok
        return out

    def breach(why: str) -> WriteUp:
        read = inputs()
        return WriteUp(why, read, tuple(
            ConditionResult(name, "gt", target, measured, "ms", True, "test")
            for name, measured, target in (
                ("ttft_p99_ms", read["ttft_p99_ms"], read["sla_ttft_p99_ms"]),
                ("itl_p99_ms", read["itl_p99_ms"], read["sla_itl_p99_ms"]))
            if isinstance(measured, int | float) and isinstance(target, int | float)
            and measured > target))

    if ok is not False:
        limit = params.queue_share_of_ttft_sla
        if ok and share is not None and limit is not None and share >= limit:
            return _saturation(view, ctx, inputs, ConditionResult(
                "queue_share_of_ttft_sla", "ge", limit, share, _unit("queue_share_of_ttft_sla"),
                True, "test"))
        return RuleOutcome(None, lambda: WriteUp("SLA met" if ok else "SLA not measured yet",
                                                 inputs()))
    if not ctx.candidates:
        return RuleOutcome(None, lambda: breach(
            f"{view.engine} breaks the SLA but no other engine meets it"))

    # The quickest way out: the candidates that serve soonest (build and cold start), the
    # one that saves most among them; a cheaper engine with a long build can follow once
    # the breach is over (docs/decisions.md).
    facts = view.signals.facts
    ready = {e: ready_in_s(facts.engines.get(e)) for e in ctx.candidates}
    soonest = min(ready.values())

    def rank(engine: str) -> tuple[float, int]:
        est = ctx.candidates[engine]
        return (-(est.savings_usd_per_h if est else float("-inf")), ctx.order.index(engine))
    target = min((e for e in ctx.candidates if ready[e] - soonest <= READY_TIE_S), key=rank)
    slower = sorted(e for e in ctx.candidates if ready[e] - soonest > READY_TIE_S)

    def why() -> WriteUp:
        words = f"{view.engine} breaks the latency SLA; {target} meets it"
        if slower:
            words += (f" and serves soonest ({_minutes(ready[target])}; "
                      + ", ".join(f"{e} {_minutes(ready[e])}" for e in slower) + ")")
        return breach(words)
    return RuleOutcome(target, why, urgent=True, estimate=ctx.candidates[target])


# Start-up times this close are the same to a breach (one step of the cost model, a few
# rollup minutes): among them, the engine that saves most goes first.
READY_TIE_S = 300.0


def ready_in_s(ef: EngineFacts | None) -> float:
    """Seconds until an engine would serve the model from a decision: its build and cold
    start (unknown: 0, as the cost model's delay counts nothing for them)."""
    if ef is None:
        return 0.0
    return (ef.build_s or 0.0) + (ef.cold_start_s or 0.0)


def _minutes(seconds: float) -> str:
    return f"ready in {seconds / 60:.0f} min"


def _saturation(view: SignalView, ctx: RuleContext, inputs: Callable[[], dict[str, SignalValue]],
                test: ConditionResult) -> RuleOutcome:
    """The SLA holds but the queue says the engine is saturating: move (not urgent) to
    the candidate with the most capacity per replica, if it has more than this one."""
    facts = view.signals.facts
    mine = facts.engines.get(view.engine)
    here = None if mine is None else mine.capacity_rps
    more = {e: c.capacity_rps for e in ctx.candidates
            if (c := facts.engines.get(e)) is not None and c.capacity_rps is not None
            and (here is None or c.capacity_rps > here)}
    seen = f"queue p99 at {test.observed:.0%} of the TTFT target" if is_number(
        test.observed) else "queue p99 high"
    if not more:
        return RuleOutcome(None, lambda: WriteUp(
            f"{seen} (saturation coming) but no engine that meets the SLA has more capacity "
            f"per replica", inputs(), (test,)))
    target = max(more, key=lambda e: (more[e], -ctx.order.index(e)))
    return RuleOutcome(target, lambda: WriteUp(
        f"{seen} on {view.engine} (saturation coming before TTFT breaks); {target} has more "
        f"capacity per replica", inputs(), (test,)), estimate=ctx.candidates[target])


def _savings(rule: Rule, params: SavingsParams, ctx: RuleContext) -> RuleOutcome:
    view = ctx.view
    known = {e: est for e, est in ctx.candidates.items() if est is not None}
    if not known:
        if not ctx.price_known:
            return RuleOutcome(None, lambda: WriteUp(NO_PRICE_NOTE))
        return RuleOutcome(None, lambda: WriteUp(
            "no engine to compare with (capacity or traffic not measured)"))
    ests = list(known.values())  # most models have one candidate: no ranking to do
    best = ests[0] if len(ests) == 1 else max(
        ests, key=lambda est: (est.net_usd, -ctx.order.index(est.target)))
    margin = best.margin_usd + params.min_net_savings_usd
    pays = best.net_usd > margin

    def write(why: str) -> WriteUp:
        inputs: dict[str, SignalValue] = {
            "savings_usd_per_h": best.savings_usd_per_h, "switch_usd": best.switch_usd,
            "churn_usd": best.churn_usd, "net_savings_usd": best.net_usd, "margin_usd": margin,
            "savings_short_usd_per_h": best.savings_short_usd_per_h,
            "savings_long_usd_per_h": best.savings_long_usd_per_h,
            "savings_basis": best.savings_basis,
        }
        if best.release_trial:
            inputs["release_trial"] = best.release_trial
        return WriteUp(why, inputs, (ConditionResult(
            "net_savings_usd", "gt", margin, best.net_usd, _unit("net_savings_usd"), pays,
            "test"),))

    if pays:
        trial = " if the new release reaches the top of its band (a release trial)" if (
            best.release_trial) else ""
        return RuleOutcome(best.target, lambda: write(
            f"moving to {best.target} saves ${best.net_usd:,.2f} net over the horizon (margin "
            f"${margin:,.2f}){trial}"), estimate=best)
    return RuleOutcome(view.engine, lambda: write(
        f"best move ({best.target}) nets ${best.net_usd:,.2f} over the horizon, under the "
        f"margin ${margin:,.2f}"), estimate=best)


# Kinds whose move answers a measured SLA breach: the only ones evaluated before minHistory.
BREACH_RULE_KINDS = frozenset({"sla-guard"})

RULE_KINDS: dict[str, RuleKind] = {
    "sla-guard": RuleKind("move off an engine that breaks the latency SLA (at once: bypasses "
                          "dwell and minHistory when measured), or whose queue time says it is "
                          "saturating (within the guardrails)",
                          SlaGuardParams, conditions=False, prefer=False, evaluate=_sla_guard),
    "expected-savings": RuleKind("move when expected savings over the horizon, net of switch and "
                                 "rebuild costs, exceed the switch cost by the hysteresis margin",
                                 SavingsParams, conditions=False, prefer=False, evaluate=_savings),
    "threshold": RuleKind("prefer an engine when conditions on signals hold",
                          NoParams, conditions=True, prefer=True, evaluate=_threshold),
    "static": RuleKind("always prefer one engine", NoParams, conditions=False, prefer=True,
                       evaluate=_static),
}
