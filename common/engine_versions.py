"""The engine catalog's version tables: what each engine release accepts and exports.

Per engine, rows ordered by the first release they apply to (`since`); a row holds
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
from dataclasses import dataclass, replace
from enum import StrEnum
from importlib import resources

from gearshift.common.engines import (
    SGLANG,
    TENSORRT_LLM,
    VLLM,
    HealthSemantics,
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
class LaunchFlags:
    """The spellings a release knows for the flags the agent's launch plan uses
    ("" = the release has no such flag)."""

    config_file: str = ""        # trtllm-serve: the YAML of extra LLM API options
    drain_timeout: str = ""      # lets in-flight requests finish on SIGTERM


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


def _flags(**kw: str) -> LaunchFlags:
    return LaunchFlags(**kw)


# -- vLLM ---------------------------------------------------------------------------------
# The names every vLLM row reads; rows replace what changed.
_VLLM_NAMES = VLLM.metric_names
_VLLM_SRC = ("PyPI wheel vllm=={v}: vllm/engine/arg_utils.py, vllm/entrypoints/**/cli_args.py "
             "(FrontendArgs), vllm/v1/metrics/*.py; extracted in "
             "common/engine_releases/vllm-{v}.json")


def _vllm(since: str, *, names: MetricNames, drain: str = "", note: str = "") -> EngineRelease:
    return EngineRelease(
        engine=VLLM.name, since=since, flags=_flags(drain_timeout=drain), metric_names=names,
        metric_endpoints=VLLM.metric_endpoints, health=VLLM.health,
        sources=(_VLLM_SRC.format(v=since),), note=note)


# Before 0.12 there is no vllm:engine_sleep_state (a sleeping engine looks idle).
_VLLM_TPOT_ONLY = replace(_VLLM_NAMES, itl=("time_per_output_token_seconds",),
                          kv_cache_usage=("kv_cache_usage_perc", "gpu_cache_usage_perc"),
                          sleep_state=())
_VLLM_ITL = replace(_VLLM_NAMES, itl=("inter_token_latency_seconds",
                                      "time_per_output_token_seconds"),
                    kv_cache_usage=("kv_cache_usage_perc", "gpu_cache_usage_perc"),
                    sleep_state=())
_VLLM_ITL_ONLY = replace(_VLLM_NAMES, itl=("inter_token_latency_seconds",),
                         kv_cache_usage=("kv_cache_usage_perc",))

VLLM_TABLE = VersionTable(
    engine=VLLM.name,
    rows=(
        _vllm("0.10.0", names=_VLLM_TPOT_ONLY,
              note="ITL only as vllm:time_per_output_token_seconds; no --shutdown-timeout"),
        _vllm("0.10.2", names=_VLLM_ITL,
              note="vllm:inter_token_latency_seconds next to the deprecated TPOT name"),
        _vllm("0.12.0", names=replace(_VLLM_ITL, kv_cache_usage=("kv_cache_usage_perc",),
                                      sleep_state=_VLLM_NAMES.sleep_state),
              note="vllm:gpu_cache_usage_perc gone; vllm:engine_sleep_state added"),
        _vllm("0.15.0", names=_VLLM_ITL_ONLY,
              note="vllm:time_per_output_token_seconds gone"),
        _vllm("0.18.0", names=_VLLM_ITL_ONLY, drain="--shutdown-timeout",
              note="--shutdown-timeout added"),
    ),
    until="0.34",
)

# -- TensorRT-LLM -------------------------------------------------------------------------
_TRT_PREFIXED = replace(TENSORRT_LLM.metric_names, prefixes=("trtllm_",),
                        kv_cache_usage=("kv_cache_utilization",),
                        itl=("time_per_output_token_seconds",))
_TRT_UNPREFIXED = replace(_TRT_PREFIXED, prefixes=("",))
# Seen without prefix in real captures; the rest comes from the JSON iteration stats.
_TRT_UNPREFIXED_FIGURES = ("ttft", "itl", "e2e")
_TRT_ALIAS_SRC = ("NVIDIA/TensorRT-LLM PR #9104 (opened 2025-11-12, after the 1.1 release "
                  "branch): adds `--config` as an alias of `--extra_llm_api_options` to "
                  "trtllm-serve, trtllm-bench and trtllm-eval")


def _trt(since: str, *, config: str, names: MetricNames, sources: tuple[str, ...],
         figures: tuple[str, ...] = (), note: str = "") -> EngineRelease:
    return EngineRelease(
        engine=TENSORRT_LLM.name, since=since, flags=_flags(config_file=config),
        metric_names=names, metric_endpoints=TENSORRT_LLM.metric_endpoints,
        health=TENSORRT_LLM.health, backends=TENSORRT_LLM.backends, sources=sources,
        prometheus_figures=figures, note=note)


TRTLLM_TABLE = VersionTable(
    engine=TENSORRT_LLM.name,
    rows=(
        _trt("1.0.0", config="--extra_llm_api_options", names=_TRT_UNPREFIXED,
             figures=_TRT_UNPREFIXED_FIGURES,
             sources=("docs nvidia.github.io/TensorRT-LLM/1.1.0rc2.post1 (serving_with_trtllm_"
                      "serve: `--extra_llm_api_options`)", _TRT_ALIAS_SRC,
                      "PR #5785 (/prometheus/metrics, names without prefix); "
                      "common/engine_releases/tensorrt-llm-1.0.0.json"),
             note="no `--config` alias; Prometheus names without prefix"),
        _trt("1.2.0", config="--config", names=_TRT_UNPREFIXED, figures=_TRT_UNPREFIXED_FIGURES,
             sources=(_TRT_ALIAS_SRC, "vllm-project/aibrix issue #2004 (2026-03 capture of "
                      "/prometheus/metrics without prefix); "
                      "common/engine_releases/tensorrt-llm-1.2.0.json"),
             note="`--config` alias of `--extra_llm_api_options`"),
        _trt("1.3.0", config="--config", names=_TRT_PREFIXED,
             sources=("tensorrt_llm/commands/serve.py @ 00209af1 and "
                      "tensorrt_llm/metrics/collector.py @ 050f80de (main line): "
                      "metric_prefix = \"trtllm_\"; "
                      "common/engine_releases/tensorrt-llm-1.3.0.json",),
             note="Prometheus names with the `trtllm_` prefix"),
    ),
    until="1.5",
)

# -- SGLang -------------------------------------------------------------------------------
_SGL_SRC = ("PyPI wheel sglang=={v}: sglang/srt/server_args.py, sglang/srt/arg_groups/fields/, "
            "sglang/srt/metrics/ or srt/observability/; extracted in "
            "common/engine_releases/sglang-{v}.json")


def _sgl(since: str, *, names: MetricNames = SGLANG.metric_names, read: str = "",
         note: str = "") -> EngineRelease:
    return EngineRelease(
        engine=SGLANG.name, since=since, flags=_flags(), metric_names=names,
        metric_endpoints=SGLANG.metric_endpoints, health=SGLANG.health,
        sources=(_SGL_SRC.format(v=read or since),), note=note)


_SGL_NAMES = SGLANG.metric_names
SGLANG_TABLE = VersionTable(
    engine=SGLANG.name,
    rows=(
        _sgl("0.4.10", names=replace(_SGL_NAMES, queue_time=(), preemptions=(),
                                     kv_blocks_total=()),
             note="no sglang:queue_time_seconds, num_retracted_requests, max_total_num_tokens"),
        _sgl("0.5.0", names=replace(_SGL_NAMES, preemptions=(), kv_blocks_total=()),
             read="0.5.5",  # the first 0.5 wheel read (0.5.0 could not be fetched)
             note="sglang:queue_time_seconds added (read in 0.5.5; 0.5.0-0.5.4 not read)"),
        _sgl("0.5.6", names=replace(_SGL_NAMES, preemptions=()),
             note="sglang:max_total_num_tokens added"),
        _sgl("0.5.7", note="sglang:num_retracted_requests added"),
    ),
    until="0.6",
)

TABLES: dict[str, VersionTable] = {t.engine: t for t in (VLLM_TABLE, TRTLLM_TABLE, SGLANG_TABLE)}


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
