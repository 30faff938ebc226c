"""`gearshift emulate --engine-version V`: the release's option set (unknown options exit
with status 2 and a message naming them, as the real parsers do), its metric names, and
the agent's launch plan for every deployment option parsing under each release."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gearshift.agents.emulator.app import build_app
from gearshift.agents.emulator.args import parse_engine_argv
from gearshift.agents.emulator.config import EmulatorOptions
from gearshift.agents.emulator.flavors import get_flavor
from gearshift.agents.emulator.releases import check_options, unknown_options
from gearshift.agents.emulator.server import make_state
from gearshift.agents.runtimes.base import get_runtime
from gearshift.common.engine_versions import (
    TABLES,
    extracted_releases,
    facts_for,
    release_facts,
    release_for,
)
from gearshift.common.engines import ENGINE_NAMES, engine_entry
from gearshift.common.spec import DeploymentSpec

EMULATE = [sys.executable, "-m", "gearshift.agents.emulator"]


def emulate(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EMULATE, *argv], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "GEARSHIFT_EMULATOR_LOAD_S": "0"})


def test_trtllm_before_the_alias_refuses_config_like_click(tmp_path: Path):
    extra = tmp_path / "extra.yaml"
    extra.write_text("enable_iter_perf_stats: true\n")
    done = emulate("--flavor", "tensorrt-llm", "--engine-version", "1.1.0", "--",
                   "org/m", "--port", "0", "--config", str(extra))
    assert done.returncode == 2
    assert "No such option: --config" in done.stderr and "1.0.0" in done.stderr


def test_vllm_before_shutdown_timeout_refuses_it_like_argparse():
    done = emulate("--flavor", "vllm", "--engine-version", "0.11", "--",
                   "serve", "m", "--port", "0", "--shutdown-timeout", "5")
    assert done.returncode == 2
    assert "unrecognized arguments: --shutdown-timeout" in done.stderr


def test_engine_version_that_does_not_parse_is_a_usage_error():
    done = emulate("--flavor", "vllm", "--engine-version", "latest", "--", "serve", "m")
    assert done.returncode == 2 and "--engine-version" in done.stderr


def test_vllm_parser_spellings_are_accepted():
    facts = release_facts("vllm", "0.33.0")
    argv = ["serve", "m", "--served_model_name", "x", "--no-enable-prefix-caching",
            "--compilation-config.level", "3", "-tp", "2", "--max-model-len=4096"]
    assert unknown_options("vllm", argv, facts) == []
    # trtllm-serve is click: no dash/underscore rewriting.
    trt = release_facts("tensorrt-llm", "1.3.0")
    assert unknown_options("tensorrt-llm", ["m", "--tp-size", "2"], trt) == ["--tp-size"]


def _options_for(version: str, engine: str) -> EmulatorOptions:
    facts = release_facts(engine, version)
    return EmulatorOptions(capacity_rps=40.0, load_s=0.0, ttft_base_s=0.002, itl_s=0.001,
                           output_tokens=4, engine_version=version, release_facts=facts)


async def _families(engine: str, version: str, argv: list[str]) -> set[str]:
    """Metric families served by an in-process emulator of `version` after one request."""
    state = make_state(parse_engine_argv(engine, argv), _options_for(version, engine))
    runner = web.AppRunner(build_app(state), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    url = f"http://{host}:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/completions",
                                 json={"prompt": "a b", "max_tokens": 3}) as resp:
                assert resp.status == 200
            async with http.get(f"{url}/metrics") as resp:
                text = await resp.text()
    finally:
        await runner.cleanup()
    return {f.name for f in text_string_to_metric_families(text)}


async def test_vllm_metric_names_follow_the_release():
    argv = ["serve", "org/m", "--served-model-name", "m"]
    old = await _families("vllm", "0.10.0", argv)
    new = await _families("vllm", "0.33.0", argv)
    assert "vllm:time_per_output_token_seconds" in old
    assert "vllm:inter_token_latency_seconds" not in old
    assert "vllm:inter_token_latency_seconds" in new
    assert "vllm:time_per_output_token_seconds" not in new
    assert "process_cpu_seconds" in new or "process_virtual_memory_bytes" in new


DEFAULT_ARGV = {"vllm": ["serve", "org/m"], "tensorrt-llm": ["org/m"],
                "sglang": ["--model-path", "org/m"]}
# What the TensorRT-LLM runtime always writes: both metric surfaces on.
TRTLLM_EXTRA = "enable_iter_perf_stats: true\nreturn_perf_metrics: true\n"


DEFAULT_ARGV = {"vllm": ["serve", "org/m"], "tensorrt-llm": ["org/m"],
                "sglang": ["--model-path", "org/m"]}
# What the TensorRT-LLM runtime always writes: both metric surfaces on.
TRTLLM_EXTRA = "enable_iter_perf_stats: true\nreturn_perf_metrics: true\n"


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_default_release_is_an_extracted_one(engine):
    flavor = get_flavor(engine)
    facts = facts_for(release_for(engine, flavor.default_version))
    assert facts is not None and not facts.derived
    assert facts.version == flavor.default_version


# The emulated trtllm-serve gives these figures on its JSON /metrics (iteration stats) only.
TRTLLM_JSON_FIGURES = {"prompt_tokens", "generation_tokens", "running", "waiting",
                       "kv_cache_usage"}
# SGLang registers its token-length histograms only with --collect-tokens-histogram
# (sglang/srt/metrics/collector.py of 0.4.10, `if collect_tokens_histogram:`), which the
# runtime does not pass: the emulator leaves them out too.
SGLANG_OPT_IN_FIGURES = {"prompt_length", "generation_length"}
ROWS = [(e, row) for e in ENGINE_NAMES for row in TABLES[e].rows]


@pytest.mark.parametrize(("engine", "row"), ROWS, ids=[f"{e}-{r.since}" for e, r in ROWS])
def test_emulated_release_serves_the_names_its_row_reads(engine, row, tmp_path: Path):
    """Emulating a release of each row (the production `make_state` path, release filter
    included) serves each figure the row reads under the row's first spelling."""
    facts = facts_for(release_for(engine, row.since))
    assert facts is not None
    options = EmulatorOptions(capacity_rps=40.0, engine_version=facts.version,
                              release_facts=facts,
                              trtllm_prefixed_names="trtllm_" in row.metric_names.prefixes)
    argv = list(DEFAULT_ARGV[engine])
    if engine == "tensorrt-llm":
        extra = tmp_path / "extra.yaml"
        extra.write_text(TRTLLM_EXTRA)
        argv += ["--extra_llm_api_options", str(extra)]
    state = make_state(parse_engine_argv(engine, argv), options)
    families = {f.name.removesuffix("_created")
                for f in text_string_to_metric_families(state.metrics.render().decode())}
    names = row.metric_names
    for figure in row.figures:
        if engine == "tensorrt-llm" and figure in TRTLLM_JSON_FIGURES:
            continue
        if engine == "sglang" and figure in SGLANG_OPT_IN_FIGURES:
            continue
        assert names.prefixes[0] + getattr(names, figure)[0] in families, (figure, facts.version)


# -- conformance: the agent's launch plan under every extracted release -----------------

SPEC_VARIANTS = {
    "tensor_parallel_size": (1, 4),
    "gpu_memory_fraction": (0.9, 0.55),
    "shutdown_timeout_s": (0.0, 30.0),
    "gpu_indices": ((), "tp"),
}


def _specs(engine: str) -> list[DeploymentSpec]:
    specs = []
    backends = engine_entry(engine).backends or ("",)
    for backend, (tp, frac, timeout, gpus) in itertools.product(
            backends, itertools.product(*SPEC_VARIANTS.values())):
        specs.append(DeploymentSpec(
            deployment_id="d1", model="m1", engine=engine, source="org/model",
            backend=backend, tensor_parallel_size=tp, gpu_memory_fraction=frac,
            shutdown_timeout_s=timeout, gpu_indices=tuple(range(tp)) if gpus else ()))
    return specs


EXTRACTED = [(e, v) for e in ENGINE_NAMES for v in extracted_releases(e)]


@pytest.mark.parametrize(("engine", "version"), EXTRACTED)
def test_launch_plan_parses_under_the_release_option_set(engine, version, tmp_path: Path):
    resolved = release_for(engine, version)
    facts = release_facts(engine, version)
    executable = list(engine_entry(engine).executable)
    for spec in _specs(engine):
        plan = get_runtime(engine).launch_plan(spec, executable=executable, host="127.0.0.1",
                                               port=8000, workdir=tmp_path, release=resolved.row)
        argv = list(plan.argv[len(executable):])
        check_options(engine, argv, facts)  # raises, naming the flag, on any unknown option
        parsed = parse_engine_argv(engine, argv)
        assert parsed.tensor_parallel_size == spec.tensor_parallel_size
        assert parsed.gpu_memory_fraction == spec.gpu_memory_fraction
