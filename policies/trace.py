"""Reader for backtest traces (docs/cost-model.md): JSON Lines, optionally gzipped.

The first line is the header (step, price, per-model profiles); then one
``traffic`` record per model per step, ``revision`` records and ``engine_release``
records (a new release of an engine changes some of a model's facts for it from the
step that holds its time on: `Trace.profile_at`), in time order.
Every malformed line fails with a `TraceError` naming the file, the line and
the reason; nothing is silently skipped. Per-engine figures are keyed by engine
name: a trace may name any engines of the catalog (`gearshift.common.engines`),
the same ones for every model and every per-engine field. Written by hand because the format
is ours (docs/cost-model.md); `json` does the parsing.
"""

from __future__ import annotations

import functools
import io
import json
import math
import zlib
from bisect import bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from json.scanner import make_scanner
from pathlib import Path
from typing import Any

from gearshift.common.engines import ENGINE_NAMES, is_engine
from gearshift.common.errors import InvalidArgument

TRACE_VERSION = 1
# Bounds on what is read: a small gzip can inflate to gigabytes (refused as it
# inflates, not after), and a trace is at most years of steps for a fleet's models.
MAX_TRACE_BYTES = 256 * 1024 * 1024  # after decompression
MAX_TRACE_LINES = 4_000_000
MAX_STEP_S = 366 * 86400
MAX_COUNT = 1_000_000  # GPUs per replica, minimum replicas
_READ_CHUNK_BYTES = 1024 * 1024
_PER_ENGINE_FIELDS = ("capacity_rps", "cold_start_s", "build_s", "build_overhead_usd", "ttft_p99_ms")
# The facts an engine release may replace (docs/cost-model.md), and the other fields it has.
RELEASE_FIELDS = ("capacity_rps", "ttft_p99_ms", "cold_start_s", "build_s")
_RELEASE_KEYS = frozenset({"kind", "ts", "model", "engine", "version", *RELEASE_FIELDS})
MAX_VERSION_CHARS = 64


class TraceError(InvalidArgument):
    """A trace file is malformed: the message names the file, line and reason."""


@dataclass(frozen=True)
class ModelProfile:
    """Measured facts about one model (the header's ``models`` entry)."""

    gpus_per_replica: int
    min_replicas: int
    sla_ttft_p99_ms: float
    capacity_rps: Mapping[str, float]
    cold_start_s: Mapping[str, float]
    build_s: Mapping[str, float]
    build_overhead_usd: Mapping[str, float]
    ttft_p99_ms: Mapping[str, float]
    initial_engine: str


@dataclass(frozen=True)
class EngineRelease:
    """An ``engine_release`` record: from `step` (the step that holds `ts`) on, the model's
    facts for `engine` are those of `changes` (a subset of RELEASE_FIELDS), the others
    unchanged."""

    step: int
    ts: datetime
    engine: str
    version: str
    changes: Mapping[str, float]


@dataclass(frozen=True)
class ModelSeries:
    """One model's traffic (rps per step, index = step), revision steps and engine
    releases (in time order)."""

    rps: tuple[float, ...]
    revision_steps: tuple[int, ...]
    releases: tuple[EngineRelease, ...] = ()


@dataclass(frozen=True)
class Trace:
    name: str
    start: datetime
    step_s: int
    price_per_gpu_hour: float
    headroom: float
    overlap_s: float
    profiles: Mapping[str, ModelProfile]
    series: Mapping[str, ModelSeries]

    @property
    def n_steps(self) -> int:
        return max((len(s.rps) for s in self.series.values()), default=0)

    @functools.cached_property
    def engines(self) -> tuple[str, ...]:
        """The engines this trace has figures for, in catalog order (read at every step of
        a replay: computed once)."""
        named = {e for p in self.profiles.values() for e in p.capacity_rps}
        return tuple(e for e in ENGINE_NAMES if e in named)

    def step_time(self, step: int) -> datetime:
        """Start of step `step`."""
        return datetime.fromtimestamp(self.start.timestamp() + step * self.step_s, UTC)

    @functools.cached_property
    def _eras(self) -> dict[str, tuple[tuple[int, ...], tuple[ModelProfile, ...]]]:
        """Per model: the steps where its facts change (0 first) and the profile from each."""
        out = {}
        for model, p in self.profiles.items():
            releases = self.series[model].releases if model in self.series else ()
            starts, profiles = [0], [p]
            for rel in releases:
                p = with_release(p, rel)
                if rel.step <= starts[-1]:
                    profiles[-1] = p  # several releases in one step (or before it): the last
                else:
                    starts.append(rel.step)
                    profiles.append(p)
            out[model] = (tuple(starts), tuple(profiles))
        return out

    def eras(self, model: str) -> tuple[tuple[int, ...], tuple[ModelProfile, ...]]:
        """(the steps where `model`'s facts change, 0 first; the profile in force from each)."""
        return self._eras[model]

    def profile_at(self, model: str, step: int) -> ModelProfile:
        """`model`'s facts in force at `step`: the header's, with every engine release up to
        that step applied in order."""
        starts, profiles = self._eras[model]
        return profiles[bisect_right(starts, step) - 1]

    def release_at(self, model: str, engine: str, step: int) -> EngineRelease | None:
        """The release of `engine` serving `model` at `step` (None: the header's, unnamed)."""
        found = None
        for rel in self.series[model].releases:
            if rel.step > step:
                break
            if rel.engine == engine:
                found = rel
        return found


def with_release(p: ModelProfile, rel: EngineRelease) -> ModelProfile:
    """`p` with the facts `rel` carries for its engine replaced."""
    if not rel.changes:
        return p
    fields = {f: {**getattr(p, f), rel.engine: v} for f, v in rel.changes.items()}
    return replace(p, **fields)  # type: ignore[arg-type]


def parse_ts(value: object) -> datetime:
    """An RFC 3339 UTC timestamp ('...Z' or with an offset); ValueError otherwise."""
    if not isinstance(value, str):
        raise ValueError(f"expected an RFC 3339 timestamp string, found {value!r}")
    try:
        ts = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"expected an RFC 3339 timestamp, found {value!r}") from None
    if ts.tzinfo is None:
        raise ValueError(f"timestamp {value!r} has no time zone (expected e.g. a trailing 'Z')")
    return ts.astimezone(UTC)


def format_ts(ts: datetime) -> str:
    return ts.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _number(obj: Mapping[str, Any], key: str, where: str, *, minimum: float = 0.0,
             positive: bool = False) -> float:
    if key not in obj:
        raise ValueError(f"{where}{key}: missing")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{where}{key}: expected a finite number, found {value!r}")
    if value < minimum or (positive and value <= 0):
        bound = "> 0" if positive else f">= {minimum:g}"
        raise ValueError(f"{where}{key}: expected a number {bound}, found {value!r}")
    return float(value)


def _int(obj: Mapping[str, Any], key: str, where: str, minimum: int,
         maximum: int = MAX_COUNT) -> int:
    value = obj.get(key)
    if (isinstance(value, bool) or not isinstance(value, int)
            or not minimum <= value <= maximum):
        raise ValueError(f"{where}{key}: expected an integer from {minimum} to {maximum}, "
                         f"found {_shown(value)}")
    return value


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _profile(name: str, raw: object) -> ModelProfile:
    where = f"models.{name}."
    if not isinstance(raw, dict):
        raise ValueError(f"models.{name}: expected an object, found {raw!r}")
    per_engine: dict[str, dict[str, float]] = {}
    engines: tuple[str, ...] = ()
    for field in _PER_ENGINE_FIELDS:
        block = raw.get(field)
        if not isinstance(block, dict) or not block:
            raise ValueError(f"{where}{field}: expected an object keyed by engine, found {block!r}")
        unknown = sorted(e for e in block if not is_engine(e))
        if unknown:
            raise ValueError(f"{where}{field}: unknown engine {unknown[0]!r} (known: {', '.join(ENGINE_NAMES)})")
        if not engines:
            engines = tuple(e for e in ENGINE_NAMES if e in block)
        per_engine[field] = {
            e: _number(block, e, f"{where}{field}.", positive=field == "capacity_rps")
            for e in engines
        }
        extra = sorted(set(block) - set(engines))
        if extra:
            raise ValueError(f"{where}{field}.{extra[0]}: not in {where}{_PER_ENGINE_FIELDS[0]} "
                             f"(every per-engine field names the same engines: {', '.join(engines)})")
    initial = raw.get("initial_engine", engines[0])
    if initial not in engines:
        raise ValueError(f"{where}initial_engine: expected one of {', '.join(engines)}, found {initial!r}")
    return ModelProfile(
        gpus_per_replica=_int(raw, "gpus_per_replica", where, 1),
        min_replicas=_int(raw, "min_replicas", where, 0),
        sla_ttft_p99_ms=_number(raw, "sla_ttft_p99_ms", where, positive=True),
        initial_engine=initial,
        **per_engine,  # type: ignore[arg-type]
    )


@dataclass
class _Header:
    name: str
    start: datetime
    step_s: int
    price: float
    headroom: float
    overlap_s: float
    profiles: dict[str, ModelProfile]


def _header(rec: object) -> _Header:
    if not isinstance(rec, dict) or rec.get("kind") != "header":
        raise ValueError('the first line must be the header object ({"kind":"header",...})')
    if rec.get("version") != TRACE_VERSION:
        raise ValueError(f"version: expected {TRACE_VERSION}, found {rec.get('version')!r}")
    name = rec.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, found {name!r}")
    models = rec.get("models")
    if not isinstance(models, dict) or not models:
        raise ValueError(f"models: expected a non-empty object, found {models!r}")
    return _Header(
        name=name,
        start=parse_ts(rec.get("start")),
        step_s=_int(rec, "step_s", "", 1, MAX_STEP_S),
        price=_number(rec, "price_per_gpu_hour", ""),
        headroom=_number(rec, "headroom", ""),
        overlap_s=_number(rec, "overlap_s", ""),
        profiles=_same_engines({str(m): _profile(str(m), p) for m, p in models.items()}),
    )


def _same_engines(profiles: dict[str, ModelProfile]) -> dict[str, ModelProfile]:
    """Every model must have figures for the same engines (the backtest compares them)."""
    first, *rest = profiles.items()
    for name, p in rest:
        if set(p.capacity_rps) != set(first[1].capacity_rps):
            raise ValueError(f"models.{name}.capacity_rps: names {', '.join(p.capacity_rps)}, "
                             f"but models.{first[0]} names {', '.join(first[1].capacity_rps)} "
                             "(every model names the same engines)")
    return profiles


def _step_of(ts: datetime, head: _Header) -> int:
    """The first step whose start is at or after `ts` (docs/cost-model.md)."""
    offset = (ts - head.start).total_seconds()
    if offset < 0:
        raise ValueError(f"ts {format_ts(ts)} is before the trace start {format_ts(head.start)}")
    return math.ceil(offset / head.step_s - 1e-9)


_decode = json.JSONDecoder().decode  # json.loads without its per-call argument checks
# The decoder's own C scanner: one JSON value from an index, (value, end). A line that
# is exactly one value (no surrounding whitespace: every line a trace writer makes) is
# that value; any other line goes to `_decode`, which also words the errors.
_scan = make_scanner(json.JSONDecoder())  # type: ignore[arg-type]  # typeshed names the class


def _release(rec: Mapping[str, Any], head: _Header, model: str, ts: datetime) -> EngineRelease:
    """An ``engine_release`` record, checked against the header (docs/cost-model.md)."""
    unknown = sorted(set(rec) - _RELEASE_KEYS)
    if unknown:
        raise ValueError(f"engine_release: unknown field {unknown[0]!r} (a release may carry "
                         f"{', '.join(RELEASE_FIELDS)})")
    engine = rec.get("engine")
    known = head.profiles[model].capacity_rps
    if engine not in known:
        raise ValueError(f"engine: expected one of the header's engines ({', '.join(known)}), "
                         f"found {_shown(engine)}")
    version = rec.get("version")
    if not isinstance(version, str) or not version.strip() or len(version) > MAX_VERSION_CHARS:
        raise ValueError(f"version: expected a non-empty string of at most {MAX_VERSION_CHARS} "
                         f"characters, found {_shown(version)}")
    changes = {f: _number(rec, f, "", positive=f == "capacity_rps")
               for f in RELEASE_FIELDS if f in rec}
    # The step that holds `ts`: the release runs from there on.
    step = int((ts - head.start).total_seconds() // head.step_s)
    return EngineRelease(step=step, ts=ts, engine=str(engine), version=version,
                         changes=changes)


def _decode_line(line: str) -> Any:
    try:
        rec, end = _scan(line, 0)
    except StopIteration:
        return _decode(line)
    if end != len(line):
        return _decode(line)
    return rec


def parse_trace(lines: Iterable[str], source: str = "<trace>") -> Trace:
    """Parse trace lines; raise `TraceError` naming `source`, the line and the reason."""
    head: _Header | None = None
    rps: dict[str, dict[int, float]] = {}
    revisions: dict[str, list[int]] = {}
    releases: dict[str, list[EngineRelease]] = {}
    last_ts: datetime | None = None
    last_raw_ts: object = None  # the text of last_ts, and its step and offset from a step start
    ts, step, off_step = datetime.min, 0, 0.0
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            try:
                rec = _decode_line(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
            if head is None:
                head = _header(rec)
                rps = {m: {} for m in head.profiles}
                revisions = {m: [] for m in head.profiles}
                releases = {m: [] for m in head.profiles}
                continue
            if not isinstance(rec, dict):
                raise ValueError(f"expected a JSON object, found {type(rec).__name__}")
            kind = rec.get("kind")
            if kind not in ("traffic", "revision", "engine_release"):
                raise ValueError("kind: expected 'traffic', 'revision' or 'engine_release', "
                                 f"found {_shown(kind)}")
            model = rec.get("model")
            if model not in head.profiles:
                raise ValueError(f"model {model!r} is not in the header (known: {', '.join(head.profiles)})")
            raw_ts = rec.get("ts")
            if raw_ts != last_raw_ts or not isinstance(raw_ts, str):
                # A step has a record per model, in a row: its timestamp is parsed once.
                ts = parse_ts(raw_ts)
                if last_ts is not None and ts < last_ts:
                    raise ValueError(f"ts {format_ts(ts)} goes back in time "
                                     f"(previous {format_ts(last_ts)})")
                last_ts, last_raw_ts = ts, raw_ts
                step = _step_of(ts, head)
                off_step = (ts - head.start).total_seconds() % head.step_s
            if kind == "revision":
                if not isinstance(rec.get("revision"), str):
                    raise ValueError(f"revision: expected a string, found {rec.get('revision')!r}")
                revisions[model].append(step)
                continue
            if kind == "engine_release":
                releases[model].append(_release(rec, head, model, ts))
                continue
            if off_step:
                raise ValueError(f"ts {format_ts(ts)} is not on a step boundary (step_s={head.step_s})")
            if step in rps[model]:
                raise ValueError(f"second traffic record for model {model!r} at {format_ts(ts)}")
            value = rec.get("rps")
            # The common case checked inline; anything else gets `_number`'s checks and errors.
            if type(value) is not float or not (0.0 <= value < math.inf):
                value = _number(rec, "rps", "")
            rps[model][step] = value
        except ValueError as exc:
            raise TraceError(f"{source}:{lineno}: {exc}") from None
    if head is None:
        raise TraceError(f"{source}: empty trace (expected a header line)")
    n_steps = max((max(s) + 1 for s in rps.values() if s), default=0)
    series: dict[str, ModelSeries] = {}
    for model, by_step in rps.items():
        missing = [k for k in range(n_steps) if k not in by_step]
        if missing:
            at = format_ts(datetime.fromtimestamp(head.start.timestamp() + missing[0] * head.step_s, UTC))
            raise TraceError(f"{source}: at end of file: model {model!r} has no traffic record at {at} "
                             f"({len(missing)} step(s) missing; expected one per model per step)")
        series[model] = ModelSeries(
            rps=tuple(by_step[k] for k in range(n_steps)), revision_steps=tuple(revisions[model]),
            releases=tuple(releases[model]))
    return Trace(name=head.name, start=head.start, step_s=head.step_s,
                 price_per_gpu_hour=head.price, headroom=head.headroom, overlap_s=head.overlap_s,
                 profiles=head.profiles, series=series)


def read_trace(path: str | Path) -> Trace:
    """Read a trace file (gzipped when it starts with the gzip magic number)."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            return _parse_bytes(_read_capped(f, p), p)
    except OSError as exc:
        raise TraceError(f"{p}: cannot read trace ({exc.strerror or exc})") from None


def read_trace_bytes(data: bytes, source: str = "<trace>") -> Trace:
    """`read_trace` on bytes already in memory (plain or gzipped)."""
    p = Path(source)
    return _parse_bytes(_read_capped(io.BytesIO(data), p), p)


def _parse_bytes(raw: bytes, p: Path) -> Trace:
    lines = raw.count(b"\n")
    if lines > MAX_TRACE_LINES:
        raise TraceError(f"{p}: more than {MAX_TRACE_LINES} lines ({lines})")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceError(f"{p}: not UTF-8 text (byte {exc.start})") from None
    return parse_trace(text.splitlines(), source=str(p))


def _read_capped(f: Any, p: Path) -> bytes:
    """The file's bytes, inflated when it starts with the gzip magic number; at most
    MAX_TRACE_BYTES either way (a larger or corrupt file is a `TraceError`)."""
    head = f.read(2)
    if head != b"\x1f\x8b":
        data = head + f.read(MAX_TRACE_BYTES + 1 - len(head))
        if len(data) > MAX_TRACE_BYTES:
            raise TraceError(f"{p}: larger than {MAX_TRACE_BYTES} bytes")
        return bytes(data)
    out = bytearray()
    inflater = zlib.decompressobj(wbits=31)
    buf, member_open = head, False
    try:
        while True:
            if not buf:
                buf = f.read(_READ_CHUNK_BYTES)
                if not buf:
                    break
            member_open = True
            out += inflater.decompress(buf, MAX_TRACE_BYTES + 1 - len(out))
            if len(out) > MAX_TRACE_BYTES:
                raise TraceError(f"{p}: inflates to more than {MAX_TRACE_BYTES} bytes")
            buf = inflater.unconsumed_tail
            if inflater.eof:  # concatenated gzip members: the next one starts here
                buf, member_open = inflater.unused_data, False
                inflater = zlib.decompressobj(wbits=31)
    except zlib.error as exc:
        raise TraceError(f"{p}: not a valid gzip file ({exc})") from None
    if member_open:
        raise TraceError(f"{p}: not a valid gzip file (it ends before its last member does)")
    return bytes(out)
