"""The engine catalog: every entry is complete and consistent, and every agent-side
module it names (runtime, emulator flavour) registers the engine under its name."""

from __future__ import annotations

import re
import sys

import pytest

from fixture_paths import REPO
from gearshift.agents.emulator.flavors import get_flavor
from gearshift.agents.engine_version import probe_version
from gearshift.agents.runtimes.base import get_runtime
from gearshift.common.engine_versions import VersionMatch, release_for
from gearshift.common.engines import (
    BASELINE_ENGINE,
    CATALOG,
    ENGINE_NAMES,
    MetricFormat,
    any_engine_metric_names,
    display_names,
    engine_entry,
)
from gearshift.common.errors import InvalidArgument
from gearshift.devfleet.podman_service import EMULATED_IMAGES


@pytest.mark.parametrize("entry", CATALOG, ids=lambda e: e.name)
def test_each_entry_is_complete(entry) -> None:
    assert entry.executable and entry.version_probe and entry.display_name
    assert entry.health.paths and all(p.startswith("/") for p in entry.health.paths)
    assert entry.metric_endpoints and any(not ep.optional for ep in entry.metric_endpoints)
    assert any(ep.format is MetricFormat.PROMETHEUS for ep in entry.metric_endpoints)
    assert entry.metric_names.prefixes and entry.metric_names.finished
    assert entry.default_backend == (entry.backends[0] if entry.backends else "")
    if entry.build is not None:
        assert entry.build.backends <= set(entry.backends) and entry.build.executable
    assert 0 < entry.prior.low <= entry.prior.ratio <= entry.prior.high
    assert entry.sources


@pytest.mark.parametrize("name", ENGINE_NAMES)
def test_each_entry_has_its_runtime_and_emulator_flavour(name: str) -> None:
    assert get_runtime(name).name == name
    flavor = get_flavor(name)
    assert flavor.name == name and flavor.default_capacity_rps > 0 and flavor.default_version


@pytest.mark.parametrize("entry", CATALOG, ids=lambda e: e.name)
def test_each_entry_has_its_version_table_and_emulated_image(entry) -> None:
    assert entry.versions.rows and entry.versions.until
    assert entry.image is not None and entry.image.emulated_release
    assert release_for(entry.name, entry.image.emulated_release).match is VersionMatch.KNOWN
    assert EMULATED_IMAGES[entry.name].endswith(f"-{entry.name}:{entry.image.emulated_release}")
    # `make image-engines` builds the same release by default.
    script = (REPO / "scripts" / "build-engine-images.sh").read_text(encoding="utf-8")
    built = re.search(rf'"{re.escape(entry.name)} \$\{{\w+:-([^}}]+)\}}"', script)
    assert built is not None and built.group(1) == entry.image.emulated_release


def test_display_names_name_every_engine_in_catalog_order() -> None:
    text = display_names()
    assert text.endswith(f" and {CATALOG[-1].display_name}")
    positions = [text.index(e.display_name) for e in CATALOG]
    assert positions == sorted(positions)
    assert " or " in display_names("or")


def test_backend_choice_and_build_step_follow_the_entry() -> None:
    trt, vllm = engine_entry("tensorrt-llm"), engine_entry("vllm")
    assert trt.backend_for("tensorrt") == "tensorrt" and trt.needs_build("tensorrt")
    assert trt.backend_for("bogus") == "pytorch" and not trt.needs_build("pytorch")
    assert vllm.backend_for("tensorrt") == "" and not vllm.needs_build("")
    assert trt.build is not None
    assert trt.build.argv([], source="/ckpt", output_dir="/out", tensor_parallel_size=2) == [
        "trtllm-build", "--checkpoint_dir", "/ckpt", "--output_dir", "/out", "--tp_size", "2"]
    assert vllm.drains_gracefully and not trt.drains_gracefully
    assert engine_entry(BASELINE_ENGINE).prior.ratio == 1.0


def test_unknown_engine_lists_the_known_ones() -> None:
    with pytest.raises(InvalidArgument, match=f"unknown engine 'tgi'; known: {', '.join(ENGINE_NAMES)}"):
        engine_entry("tgi")
    with pytest.raises(InvalidArgument, match="emulator flavour: unknown engine 'tgi'"):
        get_flavor("tgi")


def test_merged_metric_names_try_every_engine_prefix() -> None:
    merged = any_engine_metric_names()
    for entry in CATALOG:
        assert set(entry.metric_names.prefixes) <= set(merged.prefixes)
        assert set(entry.metric_names.running) <= set(merged.running)


async def test_version_probe_reads_the_first_version_and_fails_soft() -> None:
    py = sys.executable
    assert await probe_version([py, "-c", "print('vllm 0.11.0rc1 (build x)')"]) == "0.11.0rc1"
    assert await probe_version([py, "-c", "print('1.3.0')"]) == "1.3.0"
    assert await probe_version(["/nonexistent/engine", "--version"]) == ""
    assert await probe_version([py, "-c", "import sys; print('1.0'); sys.exit(3)"]) == ""
    assert await probe_version([py, "-c", "print('no version here')"]) == ""
    assert await probe_version([py, "-c", "import time; time.sleep(5)"], timeout_s=0.2) == ""
