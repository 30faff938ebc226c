"""Semantic warnings on a policy that is valid but probably not what was meant.

A condition list that can never hold (``gt: 10`` and ``lt: 5`` on one signal), a
NaN threshold (never true), preferences that exclude every engine, a rule that
prefers an excluded engine, or a selector that matches none of the models the
fleet knows: the policy loads and runs, and does nothing. `policy validate` and
`policy apply` print these; with ``--strict`` they are errors.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable

from gearshift.common.engines import ENGINE_NAMES
from gearshift.policies.schema import Condition, PolicyDoc
from gearshift.policies.signals import SIGNALS

Path = tuple[str | int, ...]
At = Callable[[Path, str], None]


def doc_warnings(doc: PolicyDoc, at: At) -> None:
    """Report each warning through `at(path, text)` (the loader adds file and line)."""
    spec = doc.spec
    for i, rule in enumerate(spec.rules):
        base: Path = ("spec", "rules", i)
        for key, conds in (("when", rule.when), ("whenAny", rule.when_any)):
            for j, c in enumerate(conds):
                for op, value in _numeric(c):
                    if math.isnan(value):
                        at((*base, key, j, op), f"NaN never compares true: the condition on "
                           f"{c.signal!r} never holds")
        _contradictions(rule.when, (*base, "when"), at)
        for key, conds in (("when", rule.when), ("whenAny", rule.when_any)):
            for j, c in enumerate(conds):
                _out_of_bounds(c, (*base, key, j), at)
        if rule.prefer is not None and rule.prefer in spec.preferences.exclude:
            at((*base, "prefer"), f"prefers {rule.prefer!r}, which preferences.exclude "
               f"excludes: the rule never moves a model")
    if set(ENGINE_NAMES) <= set(spec.preferences.exclude):
        at(("spec", "preferences", "exclude"), f"excludes every engine ({', '.join(ENGINE_NAMES)}): "
           f"no model can ever move")


def _numeric(c: Condition) -> list[tuple[str, float]]:
    out = [(op, v) for op, v in (("gt", c.gt), ("ge", c.ge), ("lt", c.lt), ("le", c.le))
           if v is not None]
    if isinstance(c.eq, float | int) and not isinstance(c.eq, bool):
        out.append(("eq", float(c.eq)))
    return out


def _out_of_bounds(c: Condition, path: Path, at: At) -> None:
    """A threshold outside the values the signal can take (a hit rate above 1, a
    negative queue time): the condition never holds, or always does."""
    spec = SIGNALS.get(c.signal)
    if spec is None or spec.bounds is None:
        return
    low, high = spec.bounds
    unit = f" {spec.unit}" if spec.unit and spec.unit != "ratio" else ""
    for op, v in _numeric(c):
        never = ((op in ("gt", "ge") and (v > high or (op == "gt" and v == high)))
                 or (op in ("lt", "le") and (v < low or (op == "lt" and v == low)))
                 or (op == "eq" and not low <= v <= high))
        always = ((op in ("gt", "ge") and (v < low or (op == "ge" and v == low)))
                  or (op in ("lt", "le") and (v > high or (op == "le" and v == high))))
        if never or always:
            at(path, f"{c.signal!r} lies within {low:g}..{high:g}{unit}: {op} {v:g} "
               f"{'never holds' if never else 'holds for every measured value'}")


def _contradictions(conds: list[Condition], path: Path, at: At) -> None:
    """All of `when` must hold: per signal, the numeric bounds must leave a value."""
    by_signal: dict[str, list[tuple[str, float]]] = {}
    for c in conds:
        by_signal.setdefault(c.signal, []).extend(
            (op, v) for op, v in _numeric(c) if not math.isnan(v))
    for signal, ops in by_signal.items():
        low, low_open, high, high_open = -math.inf, True, math.inf, True
        for op, v in ops:
            if op in ("gt", "ge", "eq") and (v > low or (v == low and op == "gt")):
                low, low_open = v, op == "gt"
            if op in ("lt", "le", "eq") and (v < high or (v == high and op == "lt")):
                high, high_open = v, op == "lt"
        if low > high or (low == high and (low_open or high_open)):
            shown = " and ".join(f"{op} {v:g}" for op, v in ops)
            at(path, f"the conditions on {signal!r} can never all hold ({shown})")


def selector_warnings(doc: PolicyDoc, known_models: Iterable[str], source: str) -> list[str]:
    """Names and globs of the selector, pins and freezes that match no known model
    (only meaningful when the fleet knows some)."""
    known = sorted(set(known_models))
    if not known:
        return []
    out: list[str] = []
    spec = doc.spec
    patterns: list[tuple[str, str]] = [
        *((f"spec.selector.names[{i}]", n) for i, n in enumerate(spec.selector.names)),
        *((f"spec.selector.globs[{i}]", g) for i, g in enumerate(spec.selector.globs)),
        *((f"spec.guardrails.pins.{p}", p) for p in spec.guardrails.pins),
        *((f"spec.guardrails.freezes[{i}]", f) for i, f in enumerate(spec.guardrails.freezes)),
    ]
    for where, pattern in patterns:
        if not any(fnmatch.fnmatchcase(m, pattern) for m in known):
            out.append(f"{source}: {where}: {pattern!r} matches no model the fleet knows "
                       f"({len(known)} known)")
    return out
