"""Load an EnginePolicy from YAML: parse with line marks, validate in two stages,
and return an immutable, versioned `Policy`.

Stage one is pydantic (`schema`: shapes, types, unknown keys). Stage two checks
what spans fields: registered rule kinds and signal names, rule parameters,
operators that fit the signal's type, cron expressions. Every problem becomes one
line ``FILE:LINE: key.path: expected …, found … (did you mean …?)``; all of them
are reported at once in one `PolicyError`.

PyYAML's composer gives nodes with marks; we build plain values from them
ourselves to keep a path -> line map (and to refuse duplicate keys, which
PyYAML would silently merge).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, get_args, get_origin

import yaml
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger
from pydantic import BaseModel, ValidationError

from gearshift.common.engines import ENGINE_NAMES
from gearshift.common.errors import InvalidArgument
from gearshift.policies.rules import (
    EQUALITY_OPERATORS,
    NUMBER_OPERATORS,
    RULE_KINDS,
    STRING_OPERATORS,
    condition_operator,
)
from gearshift.policies.schema import Mode, PolicyDoc, Rule, format_duration
from gearshift.policies.semantics import doc_warnings
from gearshift.policies.signals import DEPRECATED_SIGNALS, SIGNALS, SignalSettings

MAX_YAML_NODES = 20_000  # refuses alias bombs
MAX_POLICY_BYTES = 256 * 1024  # a policy is a page of YAML; the controller's limit too
# Ranges of the durations the live loop schedules and the backtest adds to dates.
MIN_INTERVAL_S = 1.0
MAX_INTERVAL_S = 7 * 86400.0
MIN_WINDOW_S = 1.0  # the demo compresses a day into seconds
MAX_WINDOW_S = 366 * 86400.0
MAX_MAINTENANCE_WINDOW_S = 31 * 86400.0
Path = tuple[str | int, ...]


class PolicyError(InvalidArgument):
    """A policy failed to load; `problems` holds one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid policy:\n  " + "\n  ".join(problems))


@dataclass(frozen=True, eq=False)
class Policy:
    """A validated policy: immutable; `version` names it in decisions; equal when the
    documents are (same digest)."""

    name: str
    digest: str  # sha256 of the canonical JSON of the document
    doc: PolicyDoc
    rule_params: tuple[Any, ...]  # validated params, one per rule
    windows: tuple[tuple[CronTrigger, float], ...]  # maintenance windows (trigger, duration s)
    source: str = "<policy>"
    deprecations: tuple[str, ...] = ()  # deprecated names used, each with where and its successor
    warnings: tuple[str, ...] = ()  # valid, but probably not what was meant (`semantics`)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    @property
    def version(self) -> str:
        return f"{self.name}@{self.digest[:12]}"

    @property
    def mode(self) -> Mode:
        return self.doc.spec.mode

    @property
    def signal_settings(self) -> SignalSettings:
        s = self.doc.spec.signals
        return SignalSettings(window_s=s.window, long_window_s=s.long_window,
                              sustained_quantile=s.sustained_quantile,
                              revision_window_s=s.revision_window)

    def in_maintenance_window(self, now: float) -> bool:
        """True when no windows are set, or `now` lies inside one."""
        if not self.windows:
            return True
        at = datetime.fromtimestamp(now, UTC)
        for trigger, duration_s in self.windows:
            opened = trigger.get_next_fire_time(None, at - timedelta(seconds=duration_s))
            if opened is not None and opened <= at:
                return True
        return False

    def to_dict(self) -> dict[str, Any]:
        return self.doc.model_dump(by_alias=True, mode="json")


# ---- YAML with marks ----------------------------------------------------------

class _Marks:
    def __init__(self) -> None:
        self.lines: dict[Path, int] = {}
        self.nodes = 0
        self.scalars = yaml.SafeLoader("")  # builds scalar values with YAML 1.1 typing


def _build(node: yaml.Node, path: Path, marks: _Marks, problems: list[str], source: str) -> Any:
    marks.nodes += 1
    if marks.nodes > MAX_YAML_NODES:
        raise _TooBig
    marks.lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = marks.scalars.construct_object(key_node) if isinstance(
                key_node, yaml.ScalarNode) else None
            line = key_node.start_mark.line + 1
            if not isinstance(key, str):
                problems.append(f"{source}:{line}: {_dotted(path) or '<top>'}: expected a string key, "
                                f"found a {type(key_node).__name__.removesuffix('Node').lower()}")
                continue
            if key in out:
                problems.append(f"{source}:{line}: {_dotted((*path, key))}: duplicate key")
                continue
            marks.lines[(*path, key)] = line
            out[key] = _build(value_node, (*path, key), marks, problems, source)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_build(n, (*path, i), marks, problems, source) for i, n in enumerate(node.value)]
    return marks.scalars.construct_object(node, deep=True)


class _TooBig(Exception):
    pass


def _dotted(path: Path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _line(marks: _Marks, path: Path) -> int:
    for n in range(len(path), -1, -1):
        if path[:n] in marks.lines:
            return marks.lines[path[:n]]
    return 1


# ---- stage one: pydantic errors as readable lines -----------------------------

def _fields_at(model: type[BaseModel], path: Path) -> list[str]:
    """The YAML keys allowed at `path` (for did-you-mean), walking the schema."""
    current: Any = model
    for part in path:
        while get_origin(current) is not None and not (isinstance(current, type)
                                                       and issubclass(current, BaseModel)):
            args = [a for a in get_args(current) if a is not type(None)]
            origin = get_origin(current)
            current = args[-1] if origin in (list, dict) or args else None
            if current is None:
                return []
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        by_alias = {f.alias or n: f for n, f in current.model_fields.items()}
        if isinstance(part, int) or part not in by_alias:
            return []
        current = by_alias[part].annotation
    if isinstance(current, type) and issubclass(current, BaseModel):
        return [f.alias or n for n, f in current.model_fields.items()]
    args = [a for a in get_args(current) if isinstance(a, type) and issubclass(a, BaseModel)]
    return [f.alias or n for n, f in args[0].model_fields.items()] if args else []


def _suggest(word: str, known: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _found(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_VALIDATOR_TAGS = frozenset(("float", "int", "bool", "str", "list", "dict", "none"))
_TAGGED = re.compile(r"^[a-z][a-z-]*\[.*\]$", re.DOTALL)  # function-before[...], literal[...]


def _is_validator_tag(part: str | int) -> bool:
    """True for the parts pydantic adds to an error location for a union member or a
    validator (``function-before[...]``, ``literal['a']``, ``float``): not YAML keys.
    A key such as ``intervl`` or ``interval`` is kept (matching on prefixes once
    dropped it, and the error was reported at its parent)."""
    return isinstance(part, str) and (part in _VALIDATOR_TAGS or bool(_TAGGED.match(part)))


def _stage_one(err: ValidationError, marks: _Marks, source: str, root: type[BaseModel],
               prefix: Path = ()) -> list[str]:
    out = []
    for e in err.errors():
        loc = (*prefix, *(p for p in e["loc"] if not _is_validator_tag(p)))
        where = f"{source}:{_line(marks, loc)}: {_dotted(loc) or '<top>'}"
        kind = e["type"]
        if kind == "extra_forbidden":
            known = _fields_at(root, loc[len(prefix):-1])
            out.append(f"{where}: unknown key; expected one of {', '.join(known) or '(none)'}"
                       f"{_suggest(str(loc[-1]), known) if loc else ''}")
        elif kind == "missing":
            out.append(f"{where}: required key is missing")
        elif kind in ("literal_error", "enum"):  # a Literal or a StrEnum (`Mode`)
            expected = e.get("ctx", {}).get("expected", "")
            choices = [c.strip().strip("'") for c in expected.replace(" or ", ",").split(",")]
            out.append(f"{where}: expected {expected}, found {_found(e['input'])}"
                       f"{_suggest(str(e['input']), choices)}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            if msg.startswith("expected"):
                out.append(f"{where}: {msg}")
            else:
                msg = msg.removeprefix("Input should be ").removeprefix("input should be ")
                out.append(f"{where}: expected {msg}, found {_found(e['input'])}")
    return list(dict.fromkeys(out))


# ---- stage two: cross-field checks ----------------------------------------------

def _stage_two(doc: PolicyDoc, marks: _Marks, source: str) -> tuple[list[str], list[Any],
                                                                     list[tuple[CronTrigger, float]]]:
    problems: list[str] = []
    params: list[Any] = []

    def at(path: Path, text: str) -> None:
        problems.append(f"{source}:{_line(marks, path)}: {_dotted(path)}: {text}")

    spec = doc.spec
    seen: dict[str, int] = {}
    for i, rule in enumerate(spec.rules):
        base: Path = ("spec", "rules", i)
        if rule.name in seen:
            at((*base, "name"), f"expected a unique rule name, found {rule.name!r} again "
               f"(first at rules[{seen[rule.name]}])")
        seen.setdefault(rule.name, i)
        kind = RULE_KINDS.get(rule.kind)
        if kind is None:
            at((*base, "kind"), f"expected one of {', '.join(RULE_KINDS)}, found {rule.kind!r}"
               f"{_suggest(rule.kind, list(RULE_KINDS))}")
            params.append(None)
            continue
        try:
            params.append(kind.params.model_validate(rule.params))
        except ValidationError as exc:
            problems.extend(_stage_one(exc, marks, source, kind.params, (*base, "params")))
            params.append(None)
        _check_rule_shape(rule, kind.conditions, kind.prefer, base, at)
    s = spec.signals
    out_of_range = _check_durations(doc, at)
    if s.long_window < s.window and not out_of_range:
        at(("spec", "signals", "longWindow"), f"expected at least the window ({s.window:g}s), "
           f"found {s.long_window:g}s")
    prefs = spec.preferences
    if len(set(prefs.order)) != len(prefs.order):
        at(("spec", "preferences", "order"), f"expected each engine once, found {prefs.order}")
    for pattern, engine in spec.guardrails.pins.items():
        if engine in prefs.exclude:
            at(("spec", "guardrails", "pins", pattern), f"expected an engine not excluded by "
               f"preferences.exclude, found {engine!r}")
    windows: list[tuple[CronTrigger, float]] = []
    for i, w in enumerate(spec.guardrails.maintenance_windows):
        path: Path = ("spec", "guardrails", "maintenanceWindows", i)
        try:
            windows.append((CronTrigger.from_crontab(w.cron, timezone=UTC), w.duration))
        except (ValueError, TypeError) as exc:
            at((*path, "cron"), f"expected a five-field crontab ('min hour day month weekday'), "
               f"found {w.cron!r} ({exc})")
            continue
        if _never_fires(w.cron):
            at((*path, "cron"), f"expected a crontab that fires, found {w.cron!r}: no month "
               f"it names has the day it names")
    return problems, params, windows


_DAYS_IN_MONTH = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def _cron_values(field: str, low: int, high: int) -> set[int] | None:
    """The numbers a crontab field names (None when it uses names or other syntax)."""
    out: set[int] = set()
    for part in field.split(","):
        base, _, step_text = part.partition("/")
        step = int(step_text) if step_text.isdigit() and int(step_text) > 0 else 1
        if step_text and step_text != str(step):
            return None
        if base == "*":
            first, last = low, high
        elif base.isdigit():
            first = last = int(base)
            if step_text:
                last = high
        elif "-" in base and all(x.isdigit() for x in base.split("-", 1)):
            first, last = (int(x) for x in base.split("-", 1))
        else:
            return None
        out.update(range(first, last + 1, step))
    return out


def _never_fires(cron: str) -> bool:
    """True for a crontab whose days never occur in its months ('0 0 31 2 *'): the
    scheduler would search to the year 9999 on every evaluation to find nothing."""
    fields = cron.split()
    if len(fields) != 5 or fields[4] != "*":
        return False  # a weekday field also lets it fire (cron ORs day and weekday)
    days, months = _cron_values(fields[2], 1, 31), _cron_values(fields[3], 1, 12)
    if not days or not months:
        return False
    return all(min(days) > _DAYS_IN_MONTH[m - 1] for m in months if 1 <= m <= 12)


def _duration_bounds(doc: PolicyDoc) -> list[tuple[Path, float, float, float]]:
    """(path, value, low, high) of every duration the live loop and the backtest use."""
    spec = doc.spec
    s, g = spec.signals, spec.guardrails
    out: list[tuple[Path, float, float, float]] = [
        (("spec", "interval"), spec.interval, MIN_INTERVAL_S, MAX_INTERVAL_S),
        (("spec", "signals", "window"), s.window, MIN_WINDOW_S, MAX_WINDOW_S),
        (("spec", "signals", "longWindow"), s.long_window, MIN_WINDOW_S, MAX_WINDOW_S),
        (("spec", "signals", "revisionWindow"), s.revision_window, MIN_WINDOW_S, MAX_WINDOW_S),
        (("spec", "signals", "minHistory"), s.min_history, 0.0, MAX_WINDOW_S),
        (("spec", "guardrails", "minDwell"), g.min_dwell, 0.0, MAX_WINDOW_S),
        (("spec", "guardrails", "cooldown"), g.cooldown, 0.0, MAX_WINDOW_S),
        (("spec", "cost", "horizon"), spec.cost.horizon, MIN_WINDOW_S, MAX_WINDOW_S),
    ]
    for i, w in enumerate(g.maintenance_windows):
        out.append((("spec", "guardrails", "maintenanceWindows", i, "duration"), w.duration,
                    MIN_INTERVAL_S, MAX_MAINTENANCE_WINDOW_S))
    for pattern, m in spec.models.items():
        for engine, p in m.engines.items():
            for key, value in (("coldStart", p.cold_start), ("build", p.build)):
                if value is not None:
                    out.append((("spec", "models", pattern, "engines", engine, key), value,
                                0.0, MAX_WINDOW_S))
    return out


def _check_durations(doc: PolicyDoc, at: Any) -> bool:
    """Range-check every duration; True when one was out of range."""
    bad = False
    for path, value, low, high in _duration_bounds(doc):
        if not low <= value <= high:
            bad = True
            shown = "0" if value == 0 else f"{value:.6g}s"
            at(path, f"expected a duration from {format_duration(low)} to {format_duration(high)}, "
               f"found {shown}")
    return bad


def _check_applicable(policy: Policy, marks: _Marks, source: str) -> None:
    """Build what the live loop and the backtest derive from the policy (its schedule,
    its maintenance windows over the horizon) so that a policy that loads can run:
    the ranges above make this hold, and a failure here is a clear error, not a
    controller that cannot schedule a stored version."""
    spec = policy.doc.spec
    try:
        IntervalTrigger(seconds=spec.interval)
        now = datetime.now(UTC).timestamp()
        for t in (now, now + spec.cost.horizon, now + spec.signals.long_window):
            policy.in_maintenance_window(t)
        timedelta(seconds=spec.signals.long_window + spec.cost.horizon)
    except (OverflowError, ValueError) as exc:
        raise PolicyError([f"{source}:{_line(marks, ('spec',))}: spec: cannot be scheduled "
                           f"({exc})"]) from None


def _check_rule_shape(rule: Rule, conditions: bool, prefer: bool, base: Path, at: Any) -> None:
    has_conds = bool(rule.when or rule.when_any)
    if conditions and not has_conds:
        at(base, f"expected 'when' or 'whenAny' conditions for kind {rule.kind!r}, found none")
    if not conditions and has_conds:
        at((*base, "when" if rule.when else "whenAny"),
           f"expected no conditions for kind {rule.kind!r}, found some")
    if prefer and rule.prefer is None:
        at(base, f"expected 'prefer: {'|'.join(ENGINE_NAMES)}' for kind {rule.kind!r}, found none")
    if not prefer and rule.prefer is not None:
        at((*base, "prefer"), f"expected no 'prefer' for kind {rule.kind!r} (it picks the engine)")
    for key, conds in (("when", rule.when), ("whenAny", rule.when_any)):
        for j, c in enumerate(conds):
            path = (*base, key, j)
            spec = SIGNALS.get(c.signal)
            if spec is None:
                at((*path, "signal"), f"expected a registered signal, found {c.signal!r}"
                   f"{_suggest(c.signal, list(SIGNALS))}; known: {', '.join(SIGNALS)}")
                continue
            ops = condition_operator(c)
            if len(ops) != 1:
                at(path, f"expected exactly one operator of gt, ge, lt, le, eq, ne, in; "
                   f"found {len(ops)}")
                continue
            op, operand = ops[0]
            allowed = {"number": NUMBER_OPERATORS, "bool": EQUALITY_OPERATORS,
                       "string": STRING_OPERATORS}[spec.kind]
            ok_type = {"number": isinstance(operand, int | float) and not isinstance(operand, bool),
                       "bool": isinstance(operand, bool),
                       "string": isinstance(operand, str | list)}[spec.kind]
            if op not in allowed or not ok_type:
                at((*path, op), f"expected a {spec.kind} comparison ({', '.join(sorted(allowed))}) "
                   f"for signal {c.signal!r}, found {op}: {_found(operand)}")


# ---- entry points ------------------------------------------------------------

def _by_line(problems: list[str], source: str) -> list[str]:
    def line(p: str) -> int:
        head = p[len(source) + 1:].split(":", 1)[0]
        return int(head) if head.isdigit() else 0
    return sorted(problems, key=line)


def load_policy(text: str, source: str = "<policy>", *, strict: bool = False) -> Policy:
    """Parse and validate a policy; raise `PolicyError` listing every problem (and,
    when `strict`, every semantic warning)."""
    marks = _Marks()
    problems: list[str] = []
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        raw = None if node is None else _build(node, (), marks, problems, source)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        raise PolicyError([f"{source}:{line}: not valid YAML: {exc.problem or exc.context}"]) from None
    except yaml.YAMLError as exc:
        raise PolicyError([f"{source}:1: not valid YAML: {exc}"]) from None
    except (_TooBig, RecursionError):
        raise PolicyError([f"{source}:1: document too large or too deeply nested "
                           f"(more than {MAX_YAML_NODES} nodes)"]) from None
    except (ValueError, TypeError) as exc:  # e.g. a malformed timestamp scalar
        raise PolicyError([f"{source}:1: not valid YAML: {exc}"]) from None
    if not isinstance(raw, dict):
        raise PolicyError([f"{source}:1: <top>: expected a mapping with apiVersion, kind, metadata "
                           f"and spec, found {_found(raw)}"])
    if problems:
        raise PolicyError(problems)
    try:
        doc = PolicyDoc.model_validate(raw)
    except ValidationError as exc:
        raise PolicyError(_by_line(_stage_one(exc, marks, source, PolicyDoc), source)) from None
    problems, params, windows = _stage_two(doc, marks, source)
    if problems:
        raise PolicyError(_by_line(problems, source))
    canonical = json.dumps(doc.model_dump(by_alias=True, mode="json"), sort_keys=True,
                           separators=(",", ":"))
    warnings: list[str] = []
    doc_warnings(doc, lambda path, text: warnings.append(
        f"{source}:{_line(marks, path)}: {_dotted(path)}: {text}"))
    if strict and warnings:
        raise PolicyError(_by_line(warnings, source))
    policy = Policy(name=doc.metadata.name,
                    digest=hashlib.sha256(canonical.encode()).hexdigest(),
                    doc=doc, rule_params=tuple(params), windows=tuple(windows), source=source,
                    warnings=tuple(_by_line(warnings, source)),
                    deprecations=tuple(_deprecations(doc, marks, source)))
    _check_applicable(policy, marks, source)
    return policy


def _deprecations(doc: PolicyDoc, marks: _Marks, source: str) -> list[str]:
    """Conditions on a signal of the old two-engine vocabulary (accepted, reported)."""
    found = []
    for i, rule in enumerate(doc.spec.rules):
        for key, conds in (("when", rule.when), ("whenAny", rule.when_any)):
            for j, c in enumerate(conds):
                if c.signal in DEPRECATED_SIGNALS:
                    path = ("spec", "rules", i, key, j, "signal")
                    found.append(f"{source}:{_line(marks, path)}: {_dotted(path)}: signal "
                                 f"{c.signal!r} is deprecated; use "
                                 f"{DEPRECATED_SIGNALS[c.signal]!r}")
    return found


def load_policy_file(path: str, *, strict: bool = False) -> Policy:
    return load_policy(read_policy_text(path), source=path, strict=strict)


def read_policy_text(path: str) -> str:
    """A policy file's text, read up to MAX_POLICY_BYTES (a device or a huge file is
    refused without reading it whole)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_POLICY_BYTES + 1)
    except OSError as exc:
        raise PolicyError([f"{path}: cannot read policy ({exc.strerror or exc})"]) from None
    if len(data) > MAX_POLICY_BYTES:
        raise PolicyError([f"{path}: policy file is larger than {MAX_POLICY_BYTES} bytes"])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError([f"{path}: not UTF-8 text (byte {exc.start})"]) from None


def policy_json_schema() -> dict[str, Any]:
    """JSON Schema of the document, with the registered rule kinds and signals as enums."""
    schema = PolicyDoc.model_json_schema(by_alias=True)
    defs = schema.get("$defs", {})
    defs["Rule"]["properties"]["kind"]["enum"] = list(RULE_KINDS)
    defs["Condition"]["properties"]["signal"]["enum"] = list(SIGNALS)
    schema["title"] = "gearshift EnginePolicy (gearshift.dev/v1)"
    return schema


def policy_mode(yaml_text: str) -> str:
    """The mode a stored policy text sets ("" when it cannot be read), without
    validating it: a version stored by an older release still shows its mode."""
    try:
        raw = yaml.safe_load(yaml_text)
    except (yaml.YAMLError, ValueError, TypeError, RecursionError):
        return ""
    spec = raw.get("spec") if isinstance(raw, dict) else None
    mode = spec.get("mode", "dry-run") if isinstance(spec, dict) else ""
    return mode if isinstance(mode, str) else ""
