"""SGLang end to end on the agent side: its real command line (runtime) read back by the
emulator flavour, SGLang's HTTP surface and `sglang:` metrics over loopback, the
parser on the SGLang fixtures, and the scraper on an emulated SGLang server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gearshift.agents.emulator.app import build_app
from gearshift.agents.emulator.args import EngineArgsError, parse_engine_argv
from gearshift.agents.emulator.config import EmulatorOptions, Faults
from gearshift.agents.emulator.server import drain_grace_s, make_state
from gearshift.agents.metrics import EngineScraper, parse_prometheus_text
from gearshift.agents.runtimes.base import HealthState, classify_health, get_runtime
from gearshift.common.engines import engine_entry
from gearshift.common.spec import DeploymentSpec

# The SGLang fixtures live in the repository's copy (see SOURCES.md there).
FIXTURES = Path(__file__).parents[2] / "fixtures" / "engine-metrics"
FAST = EmulatorOptions(capacity_rps=40.0, load_s=0.0, ttft_base_s=0.002, itl_s=0.001,
                       output_tokens=4, engine_version="0.5.3")
ARGV = ["--model-path", "Qwen/Qwen2.5-7B-Instruct", "--served-model-name", "qwen",
        "--enable-metrics"]


def _spec(**overrides: object) -> DeploymentSpec:
    fields: dict[str, object] = {"deployment_id": "d1", "model": "qwen", "engine": "sglang",
                                 "source": "Qwen/Qwen2.5-7B-Instruct", "tensor_parallel_size": 2,
                                 "gpu_memory_fraction": 0.85, "gpu_indices": (2, 3),
                                 "extra_args": ("--context-length", "8192")}
    fields.update(overrides)
    return DeploymentSpec(**fields)  # type: ignore[arg-type]


def test_runtime_builds_the_real_launch_server_command_line(tmp_path: Path) -> None:
    entry = engine_entry("sglang")
    plan = get_runtime("sglang").launch_plan(_spec(), executable=list(entry.executable),
                                             host="127.0.0.1", port=30001, workdir=tmp_path)
    assert plan.argv == (
        "python3", "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen2.5-7B-Instruct",
        "--host", "127.0.0.1", "--port", "30001", "--served-model-name", "qwen",
        "--tp-size", "2", "--mem-fraction-static", "0.85", "--enable-metrics",
        "--context-length", "8192")
    assert plan.env == {"CUDA_VISIBLE_DEVICES": "2,3"} and plan.served_model_name == "qwen"
    # The emulator reads back exactly what the runtime wrote.
    args = parse_engine_argv("sglang", list(plan.argv[3:]))
    assert (args.model, args.served_model_name, args.host, args.port) == (
        "Qwen/Qwen2.5-7B-Instruct", "qwen", "127.0.0.1", 30001)
    assert args.tensor_parallel_size == 2 and args.gpu_memory_fraction == 0.85
    assert args.enable_metrics and args.ignored == ("--context-length", "8192")


def test_parser_defaults_spellings_and_errors() -> None:
    args = parse_engine_argv("sglang", ["--model", "m", "--tensor-parallel-size", "4"])
    assert (args.host, args.port, args.tensor_parallel_size) == ("127.0.0.1", 30000, 4)
    assert not args.enable_metrics and args.served_model_name == "m"
    with pytest.raises(EngineArgsError, match="missing --model-path"):
        parse_engine_argv("sglang", ["--port", "1"])
    with pytest.raises(EngineArgsError, match="positional"):
        parse_engine_argv("sglang", ["serve", "--model-path", "m"])
    with pytest.raises(EngineArgsError, match=r"--mem-fraction-static: 1\.5 must be in"):
        parse_engine_argv("sglang", ["--model-path", "m", "--mem-fraction-static", "1.5"])


def test_health_503_means_starting_until_ready_then_unhealthy() -> None:
    health = engine_entry("sglang").health
    assert classify_health(health, 503, ready_before=False) is HealthState.LOADING
    assert classify_health(health, 503, ready_before=True) is HealthState.DEAD
    assert classify_health(health, 200, ready_before=False) is HealthState.READY
    assert drain_grace_s(parse_engine_argv("sglang", ARGV)) > 0


@asynccontextmanager
async def serving(argv: list[str], options: EmulatorOptions = FAST) -> AsyncIterator[str]:
    runner = web.AppRunner(build_app(make_state(parse_engine_argv("sglang", argv), options)),
                           access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def test_http_surface_health_model_info_and_openai() -> None:
    async with serving(ARGV) as url, aiohttp.ClientSession() as http:
        for path in ("/health", "/health_generate"):
            async with http.get(url + path) as resp:
                assert resp.status == 200, path
        async with http.get(f"{url}/get_model_info") as resp:
            info = await resp.json()
        assert info["model_path"] == "Qwen/Qwen2.5-7B-Instruct" and info["is_generation"]
        async with http.get(f"{url}/v1/models") as resp:
            [model] = (await resp.json())["data"]
        assert model["id"] == "qwen" and model["owned_by"] == "sglang"
        async with http.post(f"{url}/emulator/faults", json={"health": "fail"}) as resp:
            assert resp.status == 200
        async with http.get(f"{url}/health") as resp:
            assert resp.status == 503
    async with (serving(ARGV[:-1]) as url,  # no --enable-metrics
                aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp):
        assert resp.status == 404


async def test_metrics_use_sglang_names_and_the_collector_buckets() -> None:
    async with serving(ARGV) as url, aiohttp.ClientSession() as http:
        for _ in range(3):
            async with http.post(f"{url}/v1/completions",
                                 json={"model": "qwen", "prompt": "a b c", "max_tokens": 4}) as r:
                assert r.status == 200
        async with http.get(f"{url}/metrics") as resp:
            text = await resp.text()
    ours = {f.name: f for f in text_string_to_metric_families(text)}
    derived = {f.name: f for f in text_string_to_metric_families(
        (FIXTURES / "sglang-0.5-collector-derived-metrics.txt").read_text())}
    for name, family in derived.items():
        assert ours[name].type == family.type, name
        if family.type == "histogram":
            def bounds(f):  # type: ignore[no-untyped-def]
                return [s.labels["le"] for s in f.samples if s.name.endswith("_bucket")]
            assert bounds(ours[name]) == bounds(family), name
    snap = parse_prometheus_text(text, names=engine_entry("sglang").metric_names)
    assert snap.requests_finished == 3 and snap.request_errors == 0
    assert snap.generation_tokens == 12 and snap.ttft is not None and snap.ttft.count == 3
    assert snap.itl is not None and snap.itl.count == 9


def test_parser_reads_the_sglang_docs_capture() -> None:
    snap = parse_prometheus_text((FIXTURES / "sglang-docs-production-metrics-example.txt")
                                 .read_text(), names=engine_entry("sglang").metric_names)
    assert snap.prompt_tokens == 8.128902e6 and snap.generation_tokens == 7.557572e6
    assert (snap.running, snap.waiting, snap.kv_cache_usage) == (162.0, 2826.0, 0.28)
    assert snap.ttft is not None and snap.ttft.count == 11008.0
    assert snap.e2e is not None and snap.e2e.count == 11228.0
    # The older capture has only time_per_output_token_seconds: read as ITL.
    assert snap.itl is not None and snap.itl.count == 7.400757e6
    assert snap.requests_finished is None  # no num_requests_total before 0.4.x's end
    assert not snap.skips


def test_parser_reads_the_collector_derived_exposition() -> None:
    snap = parse_prometheus_text((FIXTURES / "sglang-0.5-collector-derived-metrics.txt")
                                 .read_text(), names=engine_entry("sglang").metric_names)
    assert (snap.requests_finished, snap.request_errors) == (2048.0, 4.0)
    assert (snap.running, snap.waiting, snap.kv_cache_usage) == (12.0, 3.0, 0.19)
    assert snap.itl is not None and snap.itl.count == 522240.0


async def test_scraper_reads_an_emulated_sglang_server() -> None:
    async with (serving(ARGV) as url, aiohttp.ClientSession() as http,
                EngineScraper("sglang", url) as scraper):
        first = await scraper.scrape(now=1.0)
        for _ in range(4):
            async with http.post(f"{url}/v1/completions",
                                 json={"model": "qwen", "prompt": "x", "max_tokens": 2}):
                pass
        second = await scraper.scrape(now=3.0)
    assert "first scrape" in first.reason and second.metrics_present, second.reason
    assert second.request_rate == pytest.approx(2.0)
    assert second.kv_cache_usage is not None


async def test_scraper_says_why_when_metrics_are_not_enabled() -> None:
    async with serving(ARGV[:-1], FAST) as url, EngineScraper("sglang", url) as scraper:
        sample = await scraper.scrape(now=1.0)
    assert not sample.metrics_present and "HTTP 404" in sample.reason


def test_faults_apply_to_the_flavour() -> None:
    state = make_state(parse_engine_argv("sglang", ARGV), FAST)
    state.set_faults(Faults(latency_factor=2.0))
    assert state.engine.latency_factor == 2.0
