"""The engine version tables: ordering, matching a version to its row, pins, and every row
checked against the facts extracted from the releases it covers (common/engine_releases/)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import pytest

from gearshift.common.engine_versions import (
    TABLES,
    VersionMatch,
    check_pinned_version,
    extracted_releases,
    facts_for,
    release_facts,
    release_for,
    version_key,
)
from gearshift.common.engines import ENGINE_NAMES, engine_entry
from gearshift.common.errors import InvalidArgument

EXTRACT_SCRIPT = Path(__file__).parents[3] / "scripts" / "extract_engine_release.py"


def test_version_order_follows_pep440_for_what_engines_publish():
    ordered = ["0.9.2", "0.10.0", "0.10.1.1", "0.10.2", "1.2.0rc4", "1.2.0", "1.2.0.post1",
               "1.2.1"]
    assert sorted(ordered, key=version_key) == ordered
    assert version_key("0.11") == version_key("0.11.0") == version_key("v0.11.0")
    with pytest.raises(ValueError, match="not a release version"):
        version_key("main")


def test_every_engine_has_a_table_whose_rows_are_ordered():
    assert set(TABLES) == set(ENGINE_NAMES)
    for table in TABLES.values():
        keys = [version_key(r.since) for r in table.rows]
        assert keys == sorted(keys) and keys[-1] < version_key(table.until)
        assert all(r.sources for r in table.rows), table.engine


@pytest.mark.parametrize(("engine", "version", "row", "match"), [
    ("vllm", "0.11.2", "0.10.2", VersionMatch.KNOWN),
    ("vllm", "0.10.0", "0.10", VersionMatch.KNOWN),
    ("vllm", "0.33.1", "0.18", VersionMatch.KNOWN),
    ("vllm", "0.9.2", "0.10", VersionMatch.NEAREST),     # older than the table
    ("vllm", "0.40.0", "0.18", VersionMatch.NEAREST),    # newer than the table
    ("vllm", "", "0.18", VersionMatch.UNKNOWN),
    ("vllm", "garbage", "0.18", VersionMatch.UNKNOWN),
    ("tensorrt-llm", "1.1.0", "1.0", VersionMatch.KNOWN),
    ("tensorrt-llm", "1.2.0rc2", "1.0", VersionMatch.KNOWN),  # before 1.2.0: no alias assumed
    ("tensorrt-llm", "1.2.1", "1.2", VersionMatch.KNOWN),
    ("sglang", "0.5.3", "0.5", VersionMatch.KNOWN),
])
def test_a_version_runs_with_its_row_or_the_nearest(engine, version, row, match):
    resolved = release_for(engine, version)
    assert (resolved.row.label, resolved.match) == (row, match)
    assert resolved.flagged == (match is not VersionMatch.KNOWN)
    if resolved.flagged:
        assert f"as {row}" in resolved.describe()


def test_unknown_engine_lists_the_known_ones():
    with pytest.raises(InvalidArgument, match="known: vllm"):
        release_for("llama.cpp", "1.0")


@pytest.mark.parametrize(("pinned", "installed"), [
    ("0.11", "0.11.2"), ("0.11.2", "0.11.2"), ("1.2.0rc4", "1.2.0rc4"), ("1.0", "1.0.0"),
    ("1.0", "1"), ("", "")])
def test_a_pin_admits_its_releases(pinned, installed):
    check_pinned_version("vllm", pinned, installed)


@pytest.mark.parametrize(("pinned", "installed", "message"), [
    ("0.11", "0.12.0", "pins vllm 0.11, this host has vllm 0.12.0"),
    ("1.2.0", "1.2.0rc4", "pins vllm 1.2.0, this host has vllm 1.2.0rc4"),
    ("1.0", "1.2.1", "pins vllm 1.0, this host has vllm 1.2.1"),
    ("0.11", "", "version is unknown"),
])
def test_a_pin_refuses_other_releases_clearly(pinned, installed, message):
    with pytest.raises(InvalidArgument, match=message):
        check_pinned_version("vllm", pinned, installed)


# -- conformance: every row against the releases extracted from source ------------------

EXTRACTED = [(e, v) for e in ENGINE_NAMES for v in extracted_releases(e)]


def test_every_row_is_covered_by_an_extracted_release():
    for engine, table in TABLES.items():
        covered = {release_for(engine, v).row.since for v in extracted_releases(engine)}
        assert covered == {r.since for r in table.rows}, engine


@pytest.mark.parametrize(("engine", "version"), EXTRACTED)
def test_extracted_release_is_inside_the_table_and_names_its_origin(engine, version):
    facts = release_facts(engine, version)
    assert facts.engine == engine and facts.version == version
    assert facts.origin and facts.files and facts.options and facts.metrics
    assert release_for(engine, version).match is VersionMatch.KNOWN


@pytest.mark.parametrize(("engine", "version"), EXTRACTED)
def test_row_flags_are_those_the_release_knows(engine, version):
    row = release_for(engine, version).row
    options = release_facts(engine, version).options
    if engine == "vllm":
        # The drain flag is in the row exactly when the release has it.
        assert bool(row.flags.drain_timeout) == ("--shutdown-timeout" in options), version
    if engine == "tensorrt-llm":
        assert row.flags.config_file in options
        # The alias is used exactly when the release knows it.
        assert (row.flags.config_file == "--config") == ("--config" in options), version
    for flag in (row.flags.config_file, row.flags.drain_timeout):
        assert not flag or flag in options, (version, flag)


@pytest.mark.parametrize(("engine", "version"), EXTRACTED)
def test_every_figure_the_readers_need_is_in_the_release_exposition(engine, version):
    row = release_for(engine, version).row
    metrics = release_facts(engine, version).metrics
    names = row.metric_names
    for figure in row.figures:
        candidates = [p + n for n in getattr(names, figure) for p in names.prefixes]
        assert any(c in metrics for c in candidates), (version, figure, candidates)
        # The row's first spelling is the one the release exports.
        assert names.prefixes[0] + getattr(names, figure)[0] in metrics, (version, figure)


def test_facts_for_picks_the_extracted_release_at_or_below_the_version():
    assert facts_for(release_for("vllm", "0.11.2")).version == "0.11.0"
    assert facts_for(release_for("sglang", "0.5.3")).version == "0.5.5"  # nearest in its row
    assert facts_for(release_for("tensorrt-llm", "1.1.0")).derived


# -- optional: an engine package installed here is re-extracted and compared ---------------

def _installed(package: str) -> tuple[str, Path] | None:
    """(version, site-packages root) of an installed distribution, read from its metadata
    (nothing of the engine is imported)."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    return dist.version, Path(str(dist.locate_file("")))


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_installed_engine_package_matches_its_extracted_facts(engine):
    """Where an engine package is installed (a GPU host's venv, or `pip install --no-deps`),
    its own files give the same options and metric names as the stored facts of that
    release. Skipped where it is not installed (the default here: the packages need GPUs)."""
    package = engine_entry(engine).package
    found = _installed(package)
    if found is None:
        pytest.skip(f"{package} is not installed in this environment")
    version, root = found
    if version not in extracted_releases(engine):
        pytest.skip(f"{package} {version} has no extracted facts to compare with")
    spec = importlib.util.spec_from_file_location("extract_engine_release", EXTRACT_SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    options, metrics, _files = script.extract(engine, root)
    facts = release_facts(engine, version)
    assert (frozenset(options), frozenset(metrics)) == (facts.options, facts.metrics)
