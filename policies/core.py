"""The pure decision core (docs/decisions.md):
``decide(policy, signals, state, now) -> list[Decision]``, no I/O.

For each governed model: skip it when frozen or already moving; obey a pin;
otherwise ask the rules in order (the first with an opinion wins), drop targets
that break the SLA, lack hardware or are excluded, apply dwell, cooldown and
maintenance windows (an SLA move bypasses them), and finally keep only as many
moves as the concurrency budget allows, SLA moves first, then by net savings.
The live controller loop and the backtest are adapters around this function.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from gearshift.common.engines import ENGINE_NAMES, engine_entry
from gearshift.common.frozen_records import fast_init
from gearshift.policies.economics import (
    NO_PRICE_NOTE,
    CostSettings,
    MoveEstimate,
    estimate_move,
    price_of,
)
from gearshift.policies.holds import (
    NoDecision,
    NoDecisionReason,
    guardrail_hold,
    insufficient_history,
)
from gearshift.policies.loader import Policy
from gearshift.policies.model_state import release_key, trial_share
from gearshift.policies.rules import (
    BREACH_RULE_KINDS,
    RULE_KINDS,
    ConditionResult,
    RuleContext,
    RuleOutcome,
    WriteUp,
)
from gearshift.policies.schema import Rule
from gearshift.policies.signals import (
    CAPACITY_EARLIER,
    ENGINE_VERSION,
    RELEASE_TS,
    Signals,
    SignalValue,
    SignalView,
    breach_is_measured,
    is_number,
    meets_sla,
)

HOURS_PER_DAY = 24.0
# A measured capacity this far under the previous release's is a regression: the move it
# calls for is urgent (docs/decisions.md, "Engine releases").
REGRESSION_SHARE = 0.05
# Capacity sources that are the engine's own measurement on its current release.
OWN_CAPACITY_SOURCES = frozenset({"measured", "lower_bound", "upper_bound"})


class DecisionStatus(StrEnum):
    """Lifecycle of a decision, stored as its `decisions.status` column (docs/decisions.md)."""

    PROPOSED = "proposed"  # returned by the core; waits for approval in `approve` mode
    APPROVED = "approved"  # a person (or `auto` mode) accepted it
    REJECTED = "rejected"  # a person rejected it
    EXECUTING = "executing"  # a migration carries it out
    DONE = "done"  # the model serves on the target
    ROLLED_BACK = "rolled_back"  # the migration failed its checks and was undone
    SUPERSEDED = "superseded"  # a newer decision for the model replaced it


@fast_init
@dataclass(frozen=True)
class ModelState:
    """Where a model stands (times are epoch seconds)."""

    engine: str
    since: float  # when the current engine started serving
    last_switch: float | None = None  # decision time of the last accepted switch
    migrating_to: str | None = None  # a move in flight
    pinned: str | None = None  # an operator's pin, on top of the policy's pins
    frozen: bool = False  # an operator's freeze, on top of the policy's freezes
    trialled: frozenset[str] = frozenset()  # engines a trial already measured for the model
    # (engine, when its latest trial started): a release that started before it was trialled
    trialled_at: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Decision:
    model: str
    from_engine: str
    to_engine: str
    rule: str
    inputs: dict[str, SignalValue]
    expected: dict[str, float | None]  # cost_usd_per_day (negative saves), ttft_p99_ms change, …
    alternatives: tuple[tuple[str, str], ...]  # (engine or rule, why it was rejected)
    policy_version: str
    created_at: float  # epoch seconds
    urgent: bool = False
    status: DecisionStatus = DecisionStatus.PROPOSED
    reason: str = ""  # the rule's own words
    conditions: tuple[ConditionResult, ...] = ()  # what the deciding rule tested, as data
    trial_share: float | None = None  # try the target on this share first (policy `trials`)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "from_engine": self.from_engine, "to_engine": self.to_engine,
            "rule": self.rule, "reason": self.reason,
            "conditions": [c.to_dict(self.rule) for c in self.conditions],
            "trial_share": self.trial_share,
            "inputs": dict(self.inputs), "expected": dict(self.expected),
            "alternatives": [{"option": o, "why": w} for o, w in self.alternatives],
            "policy_version": self.policy_version,
            "created_at": datetime.fromtimestamp(self.created_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "urgent": self.urgent, "status": self.status.value,
        }


@dataclass
class _Plan:
    """A move the policy wants: what ranks it, and how to write it up (only the moves
    within the migration budget are written up: a large fleet may want hundreds)."""

    model: str
    urgent: bool
    net_usd: float
    write_up: Callable[[], Decision]


@dataclass
class _Evaluation:
    outcome: RuleOutcome | None = None
    rule: str = ""
    kind: str = ""  # the deciding rule's kind
    # (engine or rule, why it was rejected): a rule with no opinion gives its outcome, whose
    # reason is written only if the move is (`RuleOutcome.write_up`).
    alternatives: list[tuple[str, str | RuleOutcome]] = field(default_factory=list)


def _matches(patterns: Mapping[str, str] | list[str], model: str) -> str | None:
    for pattern in patterns:
        if fnmatch.fnmatchcase(model, pattern):
            return pattern
    return None


def selects(policy: Policy, model: str, labels: Mapping[str, str]) -> bool:
    sel = policy.doc.spec.selector
    return _names(policy)(model) and all(labels.get(k) == v for k, v in sel.labels.items())


@functools.lru_cache(maxsize=16)
def _names(policy: Policy) -> Callable[[str], bool]:
    """Whether the policy's selector names a model: one of its names, or a match of one of
    its globs (`fnmatch.fnmatchcase`), all globs compiled into one pattern."""
    sel = policy.doc.spec.selector
    if not sel.names and not sel.globs:
        return lambda model: True
    names = frozenset(sel.names)
    globs = re.compile("|".join(fnmatch.translate(g) for g in sel.globs)) if sel.globs else None
    return lambda model: model in names or (globs is not None and globs.match(model) is not None)


def cost_settings(policy: Policy) -> CostSettings:
    c = policy.doc.spec.cost
    return CostSettings(price_per_gpu_hour=c.price_per_gpu_hour,
                        build_overhead_usd=dict(c.build_overhead_usd), horizon_s=c.horizon,
                        hysteresis=policy.doc.spec.guardrails.hysteresis)


def _engine_order(policy: Policy, sig: Signals) -> tuple[str, ...]:
    """`preferences.order` ranks engines for ties; catalog engines it leaves out that the
    model has facts for come after, in catalog order."""
    order = policy.doc.spec.preferences.order
    return (*order, *(e for e in ENGINE_NAMES if e not in order and e in sig.facts.engines))


def _candidates(policy: Policy, sig: Signals, current: str, cost: CostSettings,
                order: tuple[str, ...], known: Mapping[str, MoveEstimate | None] | None = None,
                since: float | None = None, trialled: frozenset[str] = frozenset(),
                trialled_at: tuple[tuple[str, float], ...] = ()
                ) -> tuple[dict[str, MoveEstimate | None], list[tuple[str, str]]]:
    """Engines the model may move to (of `order`, `_engine_order`'s), with estimates (those
    of `known`, made for the fleet at once, else `estimate_move`'s; a new release's trial
    estimate where it nets more: `_release_trial`, given when the model chose its engine
    (`since`) and what it `trialled`); and those refused, with why."""
    prefs = policy.doc.spec.preferences
    allowed: dict[str, MoveEstimate | None] = {}
    refused: list[tuple[str, str]] = []
    for engine in order:
        if engine == current:
            continue
        facts = sig.facts.engines.get(engine)
        if engine in prefs.exclude:
            refused.append((engine, "excluded by preferences"))
        elif facts is None:
            refused.append((engine, "not available for this model"))
        elif engine_entry(engine).gpu_vendor == "NVIDIA" and sig.facts.nvidia is False:
            refused.append((engine, f"{engine_entry(engine).display_name} needs NVIDIA GPUs"))
        elif meets_sla(sig.facts, engine) is False:
            refused.append((engine, f"breaks the latency SLA (TTFT p99 {facts.ttft_p99_ms} ms > "
                                    f"{sig.facts.sla_ttft_p99_ms} ms)"))
        elif known is not None and engine in known:
            allowed[engine] = known[engine]
        else:
            allowed[engine] = estimate_move(sig, current, engine, cost)
        if engine in allowed and since is not None and (
                trial := _release_trial(sig, since, trialled, trialled_at, engine, current,
                                        cost)) is not None:
            est = allowed[engine]
            if est is None or trial.net_usd > est.net_usd:
                allowed[engine] = trial
    return allowed, refused


def trial_key(sig: Signals, since: float, engine: str) -> str:
    """What a trial of `engine` is remembered by: ``engine@version`` when the engine runs a
    release newer than the model's choice of engine (made at `since`), else the engine."""
    cite = sig.facts.citations
    version, released = cite.get(f"{ENGINE_VERSION}.{engine}"), cite.get(f"{RELEASE_TS}.{engine}")
    if isinstance(version, str) and is_number(released) and released > since:  # type: ignore[operator]
        return release_key(engine, version)
    return engine


def _release_trial(sig: Signals, since: float, trialled: frozenset[str],
                   trialled_at: tuple[tuple[str, float], ...], engine: str, current: str,
                   cost: CostSettings) -> MoveEstimate | None:
    """A release of `engine` newer than the model's choice of engine (`since`), not measured
    and not trialled yet, is estimated at the top of its capacity band: when that pays, the
    move is a trial of the release (docs/decisions.md, "Engine releases")."""
    cite = sig.facts.citations
    if f"{RELEASE_TS}.{engine}" not in cite:
        return None
    key = trial_key(sig, since, engine)
    if key == engine or key in trialled:
        return None
    released = cite[f"{RELEASE_TS}.{engine}"]
    if any(e == engine and at >= released for e, at in trialled_at):  # type: ignore[operator]
        return None  # trialled since the release started
    if cite.get(f"capacity_source.{engine}") in OWN_CAPACITY_SOURCES:
        return None
    high, ef = cite.get(f"capacity_high.{engine}"), sig.facts.engines.get(engine)
    if not is_number(high) or ef is None or ef.capacity_rps is None or high <= ef.capacity_rps:  # type: ignore[operator]
        return None
    est = estimate_move(sig, current, engine, cost, target_capacity_rps=float(high))  # type: ignore[arg-type]
    if est is None:
        return None
    return replace(est, release_trial=(
        f"{engine} {key.split('@', 1)[1]} was released after the model chose {current} and is not "
        f"measured: estimated at the top of its capacity band, {float(high):.3g} rps per "  # type: ignore[arg-type]
        f"replica ({ef.capacity_rps:.3g} expected)"))



def regressed(sig: Signals, engine: str) -> str | None:
    """Why `engine`'s current release is a measured regression for the model (its capacity
    REGRESSION_SHARE or more under the previous release's), or None."""
    cite = sig.facts.citations
    earlier, ef = cite.get(f"{CAPACITY_EARLIER}.{engine}"), sig.facts.engines.get(engine)
    if (not is_number(earlier) or ef is None or ef.capacity_rps is None
            or cite.get(f"capacity_source.{engine}") != "measured"):
        return None
    if ef.capacity_rps > earlier * (1 - REGRESSION_SHARE):  # type: ignore[operator]
        return None
    version = cite.get(f"{ENGINE_VERSION}.{engine}")
    return (f"{engine} {version or 'release'} regressed: {ef.capacity_rps:.3g} rps per replica, "
            f"{1 - ef.capacity_rps / earlier:.0%} under the previous release's "  # type: ignore[operator]
            f"{earlier:.3g}")


@functools.lru_cache(maxsize=16)
def _rules(policy: Policy) -> tuple[tuple[Rule, Any, Callable[[Rule, Any, RuleContext],
                                                                RuleOutcome], str], ...]:
    """The policy's rules in order, each with its params, its kind's `evaluate` and how an
    alternative names it: looked up once per policy, not once per model."""
    return tuple((rule, params, RULE_KINDS[rule.kind].evaluate, f"rule {rule.name}")
                 for rule, params in zip(policy.doc.spec.rules, policy.rule_params, strict=True))


def _evaluate(policy: Policy, ctx: RuleContext, refused: list[tuple[str, str]],
              kinds: frozenset[str] | None = None) -> _Evaluation:
    """The first rule (of `kinds`, or any) with an opinion decides."""
    ev = _Evaluation(alternatives=list(refused))
    current = ctx.view.engine
    for rule, params, evaluate, label in _rules(policy):
        if kinds is not None and rule.kind not in kinds:
            continue
        outcome = evaluate(rule, params, ctx)
        target = outcome.target
        if target is None:
            ev.alternatives.append((label, outcome))
            continue
        if target != current and target not in ctx.candidates:
            ev.alternatives.append((label, f"wants {target}, which is refused"))
            continue
        ev.outcome, ev.rule, ev.kind = outcome, rule.name, rule.kind
        return ev
    return ev


def _guardrail(policy: Policy, st: ModelState, now: float) -> NoDecisionReason | None:
    """The guardrail that holds a (non-urgent) move now, if any (its words: `guardrail_hold`)."""
    g = policy.doc.spec.guardrails
    if now - st.since < g.min_dwell:
        return NoDecisionReason.MIN_DWELL
    if st.last_switch is not None and now - st.last_switch < g.cooldown:
        return NoDecisionReason.COOLDOWN
    if not policy.in_maintenance_window(now):
        return NoDecisionReason.WINDOW_CLOSED
    return None


@dataclass
class _Hold:
    """A reason for no decision found after the rules ran, with what they said (written
    up only when asked: `Verdict.explain`)."""

    reason: NoDecisionReason
    ev: _Evaluation


def _expected(sig: Signals, current: str, target: str, est: MoveEstimate | None) -> dict[str, float | None]:
    cur, tgt = sig.facts.engines.get(current), sig.facts.engines.get(target)
    ttft = (None if cur is None or tgt is None or cur.ttft_p99_ms is None or tgt.ttft_p99_ms is None
            else tgt.ttft_p99_ms - cur.ttft_p99_ms)
    return {
        "cost_usd_per_day": None if est is None else -est.savings_usd_per_h * HOURS_PER_DAY,
        "ttft_p99_ms": ttft,
        "switch_cost_usd": None if est is None else est.switch_usd,
        "net_savings_usd": None if est is None else est.net_usd,
    }


def _traffic_inputs(sig: Signals) -> dict[str, SignalValue]:
    """What the savings estimate read the coming traffic from, and the forecast it had."""
    out: dict[str, SignalValue] = {"traffic_basis": sig.traffic_basis,
                                   "traffic_level_rps": sig.traffic_level_rps,
                                   "traffic_scale": sig.traffic_scale}
    if (unused := sig.forecast_unused) is not None:
        out["traffic_note"] = unused
    fc = sig.forecast
    if fc is not None:
        out.update({"forecast_sustained_rps": fc.sustained_rps, "forecast_peak_rps": fc.peak_rps,
                    "forecast_horizon_h": fc.horizon_s / 3600.0, "forecast_method": fc.method,
                    "forecast_status": fc.status, "forecast_quantile": fc.quantile})
        if fc.reason:
            out["forecast_note"] = fc.reason
        if fc.start_ts is not None:
            out["forecast_age_h"] = (sig.now - fc.start_ts) / 3600.0
    return out


def _plan_model(policy: Policy, model: str, sig: Signals, st: ModelState, now: float,
                cost: CostSettings, known: Mapping[str, MoveEstimate | None] | None = None,
                order: tuple[str, ...] | None = None) -> _Plan | NoDecisionReason | _Hold:
    """The move `model` wants, or why it wants none; `known`: its estimates made for the
    fleet (`decide`'s `estimates`), `order`: `_engine_order`'s when the caller has it."""
    g = policy.doc.spec.guardrails
    if st.frozen or (g.freezes and _matches(g.freezes, model)):
        return NoDecisionReason.FROZEN
    if st.migrating_to is not None:
        return NoDecisionReason.MIGRATING
    pin_pattern = _matches(g.pins, model) if g.pins else None
    pin = st.pinned or (g.pins[pin_pattern] if pin_pattern else None)
    if order is None:
        order = _engine_order(policy, sig)
    candidates, refused = _candidates(policy, sig, st.engine, cost, order, known, st.since,
                                      st.trialled, st.trialled_at)
    if pin is not None:
        if pin == st.engine:
            return NoDecisionReason.PINNED
        outcome = RuleOutcome(pin, lambda: WriteUp(f"pinned to {pin}"), urgent=True,
                              estimate=candidates.get(pin))
        ev = _Evaluation(outcome=outcome, rule="pin")
    else:
        # Before minHistory only a measured SLA breach may move the model, at once: the
        # rules that judge traffic need history, a breach does not (docs/decisions.md).
        young = sig.history_s < policy.doc.spec.signals.min_history
        if young and not breach_is_measured(sig.facts, st.engine):
            return NoDecisionReason.INSUFFICIENT_HISTORY
        best_net: float | None = None  # the best candidate's net savings (one or two)
        for e in candidates.values():
            if e is not None and (best_net is None or e.net_usd > best_net):
                best_net = e.net_usd
        view = SignalView(sig, st.engine, now - st.since, best_net)
        ctx = RuleContext(view, candidates, order,
                          price_known=price_of(sig.facts, cost) is not None)
        ev = _evaluate(policy, ctx, refused,
                       kinds=BREACH_RULE_KINDS if young else None)
        if ev.outcome is None:
            return _Hold(NoDecisionReason.NO_RULE_FIRED if candidates
                         else NoDecisionReason.NO_ENGINE_AVAILABLE, ev)
        if ev.outcome.target in (None, st.engine):
            return _Hold(NoDecisionReason.WITHIN_HYSTERESIS if ev.kind == "expected-savings"
                         else NoDecisionReason.CURRENT_IS_BEST, ev)
        if young and not ev.outcome.urgent:
            return _Hold(NoDecisionReason.INSUFFICIENT_HISTORY, ev)
        if (not ev.outcome.urgent and ev.kind == "expected-savings"
                and (why := regressed(sig, st.engine)) is not None):
            # The serving engine's new release measured worse: the move is urgent.
            ev.outcome = replace(ev.outcome, urgent=True, regression=why)
        if not ev.outcome.urgent and (held := _guardrail(policy, st, now)) is not None:
            return _Hold(held, ev)
    outcome = ev.outcome
    assert outcome is not None and outcome.target is not None
    return _Plan(model, outcome.urgent, outcome.estimate.net_usd if outcome.estimate else 0.0,
                 lambda: _decision(policy, model, sig, st, now, cost, ev))


def _why(ev: _Evaluation) -> str:
    """What the rules (and the refused engines) said, in their own words."""
    return "; ".join(f"{o}: {why if isinstance(why, str) else why.why}"
                     for o, why in ev.alternatives)


def _describe(policy: Policy, model: str, sig: Signals, st: ModelState, now: float,
              hold: NoDecisionReason | _Hold, budget: tuple[int, int]) -> NoDecision:
    """The words of `hold` (`budget`: maxConcurrentMigrations and the moves in flight)."""
    reason, ev = (hold.reason, hold.ev) if isinstance(hold, _Hold) else (hold, None)
    R = NoDecisionReason
    g = policy.doc.spec.guardrails
    until: float | None = None
    if reason in (R.MIN_DWELL, R.COOLDOWN, R.WINDOW_CLOSED):
        detail, until = guardrail_hold(policy, reason, st.engine, st.since, st.last_switch, now)
    elif reason is R.INSUFFICIENT_HISTORY:
        detail = insufficient_history(sig.history_s, policy.doc.spec.signals.min_history)
        if ev is not None and ev.outcome is not None:
            detail += (f"; rule {ev.rule} wants {ev.outcome.target}, not urgently "
                       f"({ev.outcome.why})")
    elif reason is R.FROZEN:
        pattern = _matches(g.freezes, model) if g.freezes else None
        detail = ("frozen by the policy's freeze " + repr(pattern) if pattern and not st.frozen
                  else "frozen by an operator")
    elif reason is R.MIGRATING:
        detail = f"a move from {st.engine} to {st.migrating_to} is in flight"
    elif reason is R.PINNED:
        detail = f"pinned to {st.engine}, where it is"
    elif reason is R.NOT_SELECTED:
        detail = "not selected by the policy's selector"
    elif reason is R.OVER_BUDGET:
        limit, in_flight = budget
        detail = (f"over the migration budget: maxConcurrentMigrations {limit}, {in_flight} "
                  "in flight, more urgent or more saving moves first")
    elif ev is not None and reason is R.NO_ENGINE_AVAILABLE:
        detail = f"no other engine available ({_why(ev)})"
    elif ev is not None and reason is R.NO_RULE_FIRED:
        detail = f"no rule fired ({_why(ev)})"
    elif ev is not None and ev.outcome is not None:  # CURRENT_IS_BEST, WITHIN_HYSTERESIS
        words = ("within hysteresis" if reason is R.WITHIN_HYSTERESIS
                 else "the current engine is the best")
        detail = f"{words}: rule {ev.rule} keeps {st.engine} ({ev.outcome.why})"
    else:
        detail = reason.value.replace("_", " ")
    return NoDecision(model, reason, detail, until)


def _decision(policy: Policy, model: str, sig: Signals, st: ModelState, now: float,
              cost: CostSettings, ev: _Evaluation) -> Decision:
    """The decision of a planned move, with its inputs, expected effect and alternatives."""
    outcome = ev.outcome
    assert outcome is not None and outcome.target is not None
    inputs: dict[str, SignalValue] = {
        "rps_current": sig.rps_current, "rps_sustained": sig.rps_sustained, "rps_peak": sig.rps_peak,
        "rps_mean": sig.rps_mean, "burstiness": sig.burstiness,
        "revisions_per_week": sig.revisions_per_week, "history_h": sig.history_s / 3600.0,
        "dwell_h": (now - st.since) / 3600.0,
        "nvidia": sig.facts.nvidia, "gpu_model": sig.facts.gpu_model,
        "sla_ttft_p99_ms": sig.facts.sla_ttft_p99_ms,
    }
    for engine, facts in sig.facts.engines.items():
        inputs[f"capacity_rps.{engine}"] = facts.capacity_rps
        inputs[f"ttft_p99_ms.{engine}"] = facts.ttft_p99_ms
    inputs.update(sig.facts.citations)
    price = price_of(sig.facts, cost)
    if sig.facts.price_source:  # the live loop's facts say where the fleet's price came from
        inputs["price_per_gpu_hour"] = price
        inputs["price_source"] = ("policy spec.cost.pricePerGpuHour"
                                  if cost.price_per_gpu_hour is not None else sig.facts.price_source)
    if price is None:
        inputs["price_note"] = NO_PRICE_NOTE
    inputs.update(_traffic_inputs(sig))
    inputs.update(outcome.inputs)
    if outcome.regression:
        inputs["regression"] = outcome.regression
    alternatives = [(o, why if isinstance(why, str) else why.why) for o, why in ev.alternatives]
    alternatives.append((st.engine, f"stay: rule {ev.rule}: {outcome.why}"))
    decision = Decision(
        model=model, from_engine=st.engine, to_engine=outcome.target, rule=ev.rule, inputs=inputs,
        expected=_expected(sig, st.engine, outcome.target, outcome.estimate),
        alternatives=tuple(alternatives), policy_version=policy.version, created_at=now,
        urgent=outcome.urgent, conditions=outcome.conditions,
        reason=f"{outcome.why}; urgent: {outcome.regression}" if outcome.regression
        else outcome.why,
        trial_share=trial_share(policy.doc.spec.trials,
                                trial_key(sig, st.since, outcome.target),
                                sig.facts.citations.get(f"capacity_source.{outcome.target}"),
                                st.trialled),
    )
    return decision


@dataclass
class Verdict:
    """What `decide_explained` found: the decisions, and each other governed model's
    reason for none (`holds`: cheap codes; `explain` writes one up)."""

    decisions: list[Decision]
    _holds: dict[str, NoDecisionReason | _Hold]
    _policy: Policy
    _signals: Mapping[str, Signals]
    _state: Mapping[str, ModelState]
    _now: float
    _budget: tuple[int, int]  # maxConcurrentMigrations, moves in flight

    def reasons(self) -> dict[str, NoDecisionReason]:
        """Model -> why it got no decision (models with a decision, or no state, absent)."""
        return {m: h.reason if isinstance(h, _Hold) else h for m, h in self._holds.items()}

    def explain(self, model: str) -> NoDecision:
        """`model`'s reason for no decision, in words (KeyError: it has none)."""
        return _describe(self._policy, model, self._signals[model], self._state[model],
                         self._now, self._holds[model], self._budget)


def decide(policy: Policy, signals: Mapping[str, Signals], state: Mapping[str, ModelState],
           now: float, *,
           estimates: Mapping[str, Mapping[str, MoveEstimate | None]] | None = None
           ) -> list[Decision]:
    """Moves the policy wants now, as data (pure: no I/O, no clock, no randomness).

    `signals` and `state` are keyed by model; a model missing from either is skipped.
    `now` is epoch seconds; signals must have been computed from data before it.
    `estimates` (model -> target -> `estimate_move`'s figures, made for a fleet at once by
    `policies.fleet_estimates`) saves estimating them here; a move it lacks is estimated.
    """
    return decide_explained(policy, signals, state, now, estimates=estimates).decisions


def decide_explained(policy: Policy, signals: Mapping[str, Signals],
                     state: Mapping[str, ModelState], now: float, *,
                     estimates: Mapping[str, Mapping[str, MoveEstimate | None]] | None = None
                     ) -> Verdict:
    """`decide`, with each other model's reason for no decision (`Verdict`)."""
    cost = cost_settings(policy)
    plans: list[_Plan] = []
    holds: dict[str, NoDecisionReason | _Hold] = {}
    orders: dict[tuple[str, ...], tuple[str, ...]] = {}  # the facts' engines -> `_engine_order`
    for model in sorted(signals):
        sig, st = signals[model], state.get(model)
        if st is None:
            continue
        if not selects(policy, model, sig.facts.labels):
            holds[model] = NoDecisionReason.NOT_SELECTED
            continue
        engines = tuple(sig.facts.engines)
        order = orders.get(engines)
        if order is None:
            order = orders[engines] = _engine_order(policy, sig)
        plan = _plan_model(policy, model, sig, st, now, cost,
                           estimates.get(model) if estimates is not None else None, order)
        if isinstance(plan, _Plan):
            plans.append(plan)
        else:
            holds[model] = plan
    limit = policy.doc.spec.guardrails.max_concurrent_migrations
    in_flight = sum(1 for s in state.values() if s.migrating_to is not None)
    budget = max(0, limit - in_flight)
    plans.sort(key=lambda p: (not p.urgent, -p.net_usd, p.model))
    for p in plans[budget:]:
        holds[p.model] = NoDecisionReason.OVER_BUDGET
    return Verdict([p.write_up() for p in plans[:budget]], holds, policy, signals, state, now,
                   (limit, in_flight))
