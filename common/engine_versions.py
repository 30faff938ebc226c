"""The engine catalog's version tables resolved: what each engine release accepts and exports.

Each catalog entry writes its version table (`EngineEntry.versions`); here each row is
completed with the entry's release-independent facts (`EngineRelease`). Per engine, rows ordered by the first release they apply to (`since`); a row holds
up to the next row's `since`, the last one up to its `until`. A row says which
command-line flags the agent's launch plan may use on those releases (by the
spelling the release knows), its health semantics, metric endpoints and metric
names, and where each fact was read (`sources`). The facts were read in each
release's own source; `common/engine_releases/<engine>-<version>.json` holds what
`scripts/extract_engine_release.py` extracted from one release (its option names
and metric names, with the file and origin they came from), and the conformance
tests (`tests/unit/common/test_engine_versions.py`) check every row against every
extracted release it covers.

`release_for(engine, version)` picks the row of a version: the row whose range
holds it (`VersionMatch.KNOWN`), else the nearest row (`NEAREST`: older than the
oldest row or newer than the newest), else the newest row (`UNKNOWN`: no version
could be read). Either of the last two is flagged in the host report.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from enum import StrEnum
from importlib import resources

from gearshift.common.engines import (
    CATALOG,
    EngineEntry,
    HealthSemantics,
    LaunchFlags,
    MetricEndpoint,
    MetricNames,
    engine_entry,
)
from gearshift.common.errors import InvalidArgument

_VERSION_RE = re.compile(r"^v?(\d+(?:\.\d+)*)(?:[.-]?(a|b|rc|dev|post)\.?(\d*))?")
_PRE_ORDER = {"dev": 0, "a": 1, "b": 2, "rc": 3, "": 4, "post": 5}


def version_key(version: str) -> tuple[tuple[int, ...], int, int]:
    """A sort key for a release version (PEP 440 subset: 1.2.0rc4 < 1.2.0 < 1.2.0.post1).

    `ValueError` when `version` does not start with a number."""
    found = _VERSION_RE.match(version.strip())
    if not found:
        raise ValueError(f"not a release version: {version!r}")
    numbers = tuple(int(p) for p in found.group(1).split("."))
    while len(numbers) > 1 and numbers[-1] == 0:  # 0.11 == 0.11.0
        numbers = numbers[:-1]
    return numbers, _PRE_ORDER[found.group(2) or ""], int(found.group(3) or 0)


def _written_numbers(version: str) -> tuple[int, ...]:
    """The release numbers as written (1.0 -> (1, 0)); the version must parse."""
    found = _VERSION_RE.match(version.strip())
    assert found is not None, version
    return tuple(int(p) for p in found.group(1).split("."))


# Where an agent read an engine's version ("" = nowhere: the version is unknown).
# image-*: an engine that runs as a container (docs/containers.md): its image's version
# label, an environment variable of the image, the package metadata inside it, its tag.
VERSION_SOURCES = ("config", "metadata", "probe", "image-label", "image-env", "image-metadata",
                   "image-tag")
# A version string as engines and packages write them ("0.11.2", "1.2.0rc4",
# "0.10.1.dev12+g1234.cu128"): what the version table can compare and a table can show.
VERSION_TEXT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+_-]{0,63}")  # use with fullmatch


class VersionMatch(StrEnum):
    """How an engine's version relates to its version table."""

    KNOWN = "known"      # inside the table's range: its row was checked
    NEAREST = "nearest"  # outside the range: runs with the nearest row
    UNKNOWN = "unknown"  # no version could be read: runs with the newest row


@dataclass(frozen=True)
class EngineRelease:
    """One row of an engine's version table."""

    engine: str
    since: str                              # first release of the row
    flags: LaunchFlags
    metric_names: MetricNames
    metric_endpoints: tuple[MetricEndpoint, ...]
    health: HealthSemantics
    sources: tuple[str, ...]                # where the row's facts were read
    backends: tuple[str, ...] = ()          # the engine's backends on these releases
    # The `metric_names` figures these releases export in Prometheus text (() = all of
    # them); the others come from another endpoint (trtllm-serve's JSON iteration stats).
    prometheus_figures: tuple[str, ...] = ()
    note: str = ""

    @property
    def figures(self) -> tuple[str, ...]:
        """The `MetricNames` figures (fields but `prefixes`) that have names on these releases."""
        every = tuple(f for f in MetricNames.__dataclass_fields__
                      if f != "prefixes" and getattr(self.metric_names, f))
        return tuple(f for f in every if not self.prometheus_figures
                     or f in self.prometheus_figures)

    @property
    def label(self) -> str:
        """The row's name in reports: its first release without trailing zeros ("0.11")."""
        numbers = version_key(self.since)[0]
        return ".".join(str(n) for n in (numbers if len(numbers) > 1 else (*numbers, 0)))


@dataclass(frozen=True)
class ReleaseFacts:
    """What `scripts/extract_engine_release.py` read in one release's source."""

    engine: str
    version: str
    origin: str
    files: tuple[str, ...]
    options: frozenset[str]
    metrics: frozenset[str]

    @property
    def derived(self) -> bool:
        """Derived from another release's source by a documented change (a lower bound)."""
        return self.origin.startswith("derived")


@dataclass(frozen=True)
class VersionTable:
    """One engine's rows, oldest first; `until` bounds the newest row (exclusive)."""

    engine: str
    rows: tuple[EngineRelease, ...]
    until: str

    def __post_init__(self) -> None:
        keys = [version_key(r.since) for r in self.rows]
        if keys != sorted(keys) or len(set(keys)) != len(keys):
            raise ValueError(f"{self.engine}: version table rows out of order")


@dataclass(frozen=True)
class ResolvedRelease:
    """The row an engine version runs with, and how the version matched the table."""

    version: str
    row: EngineRelease
    match: VersionMatch

    @property
    def flagged(self) -> bool:
        return self.match is not VersionMatch.KNOWN

    def describe(self) -> str:
        """For reports: "0.11.1", "0.40.0 (as 0.33, newer than the version table)", ..."""
        if self.match is VersionMatch.KNOWN:
            return self.version
        if self.match is VersionMatch.UNKNOWN:
            return f"unknown version (as {self.row.label})"
        return f"{self.version} (as {self.row.label}, outside the version table)"


def _table(entry: EngineEntry) -> VersionTable:
    """The entry's version table, each row completed with the entry's release-independent facts."""
    return VersionTable(
        engine=entry.name,
        rows=tuple(EngineRelease(
            engine=entry.name, since=row.since, flags=row.flags, metric_names=row.metric_names,
            metric_endpoints=entry.metric_endpoints, health=entry.health, sources=row.sources,
            backends=entry.backends, prometheus_figures=row.prometheus_figures, note=row.note)
            for row in entry.versions.rows),
        until=entry.versions.until)


TABLES: dict[str, VersionTable] = {entry.name: _table(entry) for entry in CATALOG}


def version_table(engine: str) -> VersionTable:
    engine_entry(engine)  # InvalidArgument listing the known engines
    return TABLES[engine]


def release_for(engine: str, version: str) -> ResolvedRelease:
    """The row `version` of `engine` runs with, and how it matched (see the module doc)."""
    table = version_table(engine)
    try:
        key = version_key(version)
    except ValueError:
        return ResolvedRelease(version, table.rows[-1], VersionMatch.UNKNOWN)
    if key < version_key(table.rows[0].since):
        return ResolvedRelease(version, table.rows[0], VersionMatch.NEAREST)
    row = [r for r in table.rows if version_key(r.since) <= key][-1]
    match = VersionMatch.KNOWN if key < version_key(table.until) else VersionMatch.NEAREST
    return ResolvedRelease(version, row, match)


def check_pinned_version(engine: str, pinned: str, installed: str) -> None:
    """`InvalidArgument` when a deployment pins `pinned` and the host has `installed`.

    A pin names a release or a prefix of one: "0.11" admits 0.11.0 and 0.11.2."""
    if not pinned:
        return
    if not installed:
        raise InvalidArgument(
            f"engine_version: the deployment pins {engine} {pinned}, but this host's "
            f"{engine} version is unknown (set it in the agent config or install the engine)")
    try:
        want, have = version_key(pinned), version_key(installed)
    except ValueError as exc:
        raise InvalidArgument(f"engine_version: {exc}") from None
    # The numbers as written ("1.0" pins 1.0.x, not every 1.x): no zeros dropped.
    numbers, have_numbers = _written_numbers(pinned), _written_numbers(installed)
    have_numbers += (0,) * max(0, len(numbers) - len(have_numbers))
    # Prefix match on the release numbers ("0.11" admits 0.11.2); a pin without a
    # pre-release admits no pre-release (1.2.0 refuses 1.2.0rc4), one with it only itself.
    final = _PRE_ORDER[""]
    same_stage = have[1] >= final if want[1:] == (final, 0) else have[1:] == want[1:]
    if have_numbers[:len(numbers)] != numbers or not same_stage:
        raise InvalidArgument(
            f"engine_version: the deployment pins {engine} {pinned}, this host has "
            f"{engine} {installed}")


@functools.cache
def release_facts(engine: str, version: str) -> ReleaseFacts:
    """The facts extracted from one release (`common/engine_releases/<engine>-<version>.json`)."""
    name = f"{engine}-{version}.json"
    try:
        text = resources.files("gearshift.common").joinpath("engine_releases", name).read_text(
            encoding="utf-8")
    except (FileNotFoundError, OSError):
        raise InvalidArgument(f"no extracted release facts for {engine} {version} "
                              f"(common/engine_releases/{name})") from None
    data = json.loads(text)
    return ReleaseFacts(engine=data["engine"], version=data["version"], origin=data["origin"],
                        files=tuple(data["files"]), options=frozenset(data["options"]),
                        metrics=frozenset(data["metrics"]))


def extracted_releases(engine: str) -> tuple[str, ...]:
    """The versions of `engine` with extracted facts, oldest first."""
    folder = resources.files("gearshift.common").joinpath("engine_releases")
    prefix = f"{engine}-"
    found = [p.name[len(prefix):-len(".json")] for p in folder.iterdir()
             if p.name.startswith(prefix) and p.name.endswith(".json")
             and version_key(p.name[len(prefix):-len(".json")])]
    return tuple(sorted(found, key=version_key))


def facts_for(resolved: ResolvedRelease) -> ReleaseFacts | None:
    """The extracted release nearest below the resolved version inside its row, if any."""
    row = resolved.row
    table = TABLES[row.engine]
    rows = table.rows
    upper = next((version_key(r.since) for r in rows if version_key(r.since) > version_key(row.since)),
                 version_key(table.until))
    try:
        key = version_key(resolved.version)
    except ValueError:
        key = upper
    in_row = [v for v in extracted_releases(row.engine)
              if version_key(row.since) <= version_key(v) < upper]
    below = [v for v in in_row if version_key(v) <= key]
    chosen = below[-1] if below else (in_row[0] if in_row else "")
    return release_facts(row.engine, chosen) if chosen else None
