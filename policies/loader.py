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
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, get_args, get_origin

import yaml
from apscheduler.triggers.cron import CronTrigger
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
from gearshift.policies.schema import PolicyDoc, Rule
from gearshift.policies.signals import DEPRECATED_SIGNALS, SIGNALS, SignalSettings

MAX_YAML_NODES = 20_000  # refuses alias bombs
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

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    @property
    def version(self) -> str:
        return f"{self.name}@{self.digest[:12]}"

    @property
    def mode(self) -> str:
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


def _stage_one(err: ValidationError, marks: _Marks, source: str, root: type[BaseModel],
               prefix: Path = ()) -> list[str]:
    out = []
    for e in err.errors():
        loc = (*prefix, *(p for p in e["loc"] if not (isinstance(p, str) and p.startswith(
            ("function-", "literal[", "float", "int", "bool", "str", "list[")))))
        where = f"{source}:{_line(marks, loc)}: {_dotted(loc) or '<top>'}"
        kind = e["type"]
        if kind == "extra_forbidden":
            known = _fields_at(root, loc[len(prefix):-1])
            out.append(f"{where}: unknown key; expected one of {', '.join(known) or '(none)'}"
                       f"{_suggest(str(loc[-1]), known)}")
        elif kind == "missing":
            out.append(f"{where}: required key is missing")
        elif kind == "literal_error":
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
    if s.long_window < s.window:
        at(("spec", "signals", "longWindow"), f"expected at least the window ({s.window:g}s), "
           f"found {s.long_window:g}s")
    if s.window <= 0:
        at(("spec", "signals", "window"), "expected a duration > 0, found 0")
    if spec.interval <= 0:
        at(("spec", "interval"), "expected a duration > 0, found 0")
    if spec.cost.horizon <= 0:
        at(("spec", "cost", "horizon"), "expected a duration > 0, found 0")
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
        if w.duration <= 0:
            at((*path, "duration"), "expected a duration > 0, found 0")
    return problems, params, windows


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


def load_policy(text: str, source: str = "<policy>") -> Policy:
    """Parse and validate a policy; raise `PolicyError` listing every problem."""
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
    return Policy(name=doc.metadata.name, digest=hashlib.sha256(canonical.encode()).hexdigest(),
                  doc=doc, rule_params=tuple(params), windows=tuple(windows), source=source,
                  deprecations=tuple(_deprecations(doc, marks, source)))


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


def load_policy_file(path: str) -> Policy:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError([f"{path}: cannot read policy ({exc})"]) from None
    return load_policy(text, source=path)


def policy_json_schema() -> dict[str, Any]:
    """JSON Schema of the document, with the registered rule kinds and signals as enums."""
    schema = PolicyDoc.model_json_schema(by_alias=True)
    defs = schema.get("$defs", {})
    defs["Rule"]["properties"]["kind"]["enum"] = list(RULE_KINDS)
    defs["Condition"]["properties"]["signal"]["enum"] = list(SIGNALS)
    schema["title"] = "gearshift EnginePolicy (gearshift.dev/v1)"
    return schema
