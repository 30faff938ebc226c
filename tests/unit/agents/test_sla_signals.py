"""The SLA signals (queue time, preemptions, prefix-cache hit rate, sleep state, request
lengths, KV blocks): read from each engine's real names, turned into interval values,
and produced by the emulator in those names (read back through the agent's scraper)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from fixture_paths import ENGINE_METRICS, REPO
from gearshift.agents.emulator.app import build_app
from gearshift.agents.emulator.args import parse_engine_argv
from gearshift.agents.emulator.config import EmulatorOptions
from gearshift.agents.emulator.server import make_state
from gearshift.agents.metrics import (
    EngineScraper,
    RateCalculator,
    parse_prometheus_text,
    parse_trtllm_json,
    read_engine_metrics,
    to_proto,
)
from gearshift.agents.metrics.model import SkipReason, SleepState
from gearshift.common.engines import SGLANG, VLLM
from gearshift.v1 import agent_pb2

FAST = EmulatorOptions(capacity_rps=40.0, load_s=0.0, ttft_base_s=0.002, itl_s=0.001,
                       output_tokens=4)
needs_fixtures = pytest.mark.skipif(not ENGINE_METRICS.is_dir(),
                                    reason=f"engine metric fixtures not found at {ENGINE_METRICS}")


def vllm_text(*, queue: tuple[int, int, int], preempted: float, queries: float, hits: float,
              sleep: str = "awake", prompt: tuple[float, float] = (0.0, 0.0),
              blocks: str = "2452", usage: float = 0.5) -> str:
    """A vLLM scrape in the newest release's names (vllm/v1/metrics/loggers.py):
    queue-time buckets le=0.3, 1.0, +Inf (cumulative counts)."""
    lbl = 'engine="0",model_name="m"'
    states = "\n".join(
        f'vllm:engine_sleep_state{{{lbl},sleep_state="{s}"}} {1.0 if s == sleep else 0.0}'
        for s in ("awake", "weights_offloaded", "discard_all"))
    return f"""# TYPE vllm:request_success counter
vllm:request_success_total{{{lbl},finished_reason="stop"}} {prompt[1]}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{{lbl}}} {usage}
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{{{lbl}}} {preempted}
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{{{lbl}}} {queries}
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{{{lbl}}} {hits}
# TYPE vllm:engine_sleep_state gauge
{states}
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{{{lbl},le="0.3"}} {queue[0]}
vllm:request_queue_time_seconds_bucket{{{lbl},le="1.0"}} {queue[1]}
vllm:request_queue_time_seconds_bucket{{{lbl},le="+Inf"}} {queue[2]}
vllm:request_queue_time_seconds_count{{{lbl}}} {queue[2]}
vllm:request_queue_time_seconds_sum{{{lbl}}} {queue[2] * 0.5}
# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_bucket{{{lbl},le="+Inf"}} {prompt[1]}
vllm:request_prompt_tokens_count{{{lbl}}} {prompt[1]}
vllm:request_prompt_tokens_sum{{{lbl}}} {prompt[0]}
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",enable_prefix_caching="True",engine="0",num_gpu_blocks="{blocks}"}} 1.0
"""


def test_vllm_interval_signals_from_two_scrapes():
    calc = RateCalculator()
    first = parse_prometheus_text(vllm_text(queue=(0, 0, 0), preempted=1, queries=100, hits=0,
                                            prompt=(0, 0)), names=VLLM.metric_names)
    assert first.skips == ()
    calc.update(first, now=0.0)
    second = parse_prometheus_text(
        vllm_text(queue=(10, 90, 100), preempted=7, queries=1100, hits=250,
                  prompt=(50_000, 100), sleep="awake"), names=VLLM.metric_names)
    sample = calc.update(second, now=60.0)
    assert sample.metrics_present
    assert sample.queue_time.present and sample.queue_time.count == 100
    assert 0.3 < sample.queue_time.p50_s < 1.0 and sample.queue_time.p99_s == pytest.approx(1.0)
    assert sample.preemptions_per_s == pytest.approx(6 / 60)
    assert sample.prefix_cache_hit_rate == pytest.approx(250 / 1000)
    assert sample.sleep_state is SleepState.AWAKE
    assert sample.mean_prompt_tokens == pytest.approx(500.0)
    assert (sample.kv_blocks_total, sample.kv_blocks_used) == (2452, 1226)
    report = agent_pb2.DeploymentReport()
    to_proto(sample, report)
    assert report.queue_time.present and report.queue_time.count == 100
    assert report.HasField("prefix_cache_hit_rate") and report.prefix_cache_hit_rate == 0.25
    assert report.sleep_state == agent_pb2.ENGINE_SLEEP_STATE_AWAKE
    assert (report.kv_blocks_total, report.kv_blocks_used) == (2452, 1226)
    # This scrape has neither a generation-length histogram nor a generated-tokens counter.
    assert not report.HasField("mean_generation_tokens")


def test_absent_is_not_zero():
    """No prefix-cache queries in the interval: no hit rate (not 0); no families: unset."""
    calc = RateCalculator()
    calc.update(parse_prometheus_text(vllm_text(queue=(0, 0, 0), preempted=0, queries=5, hits=5),
                                      names=VLLM.metric_names), now=0.0)
    sample = calc.update(parse_prometheus_text(
        vllm_text(queue=(0, 0, 0), preempted=0, queries=5, hits=5), names=VLLM.metric_names),
        now=10.0)
    assert sample.prefix_cache_hit_rate is None and not sample.queue_time.present
    assert sample.preemptions_per_s == 0.0
    bare = parse_prometheus_text('# TYPE vllm:num_requests_running gauge\n'
                                 'vllm:num_requests_running{model_name="m"} 1\n',
                                 names=VLLM.metric_names)
    report = agent_pb2.DeploymentReport()
    calc = RateCalculator()
    calc.update(bare, now=0.0)
    to_proto(calc.update(bare, now=1.0), report)
    for name in ("preemptions_per_s", "prefix_cache_hit_rate", "mean_prompt_tokens",
                 "kv_blocks_total", "kv_blocks_used"):
        assert not report.HasField(name), name
    assert report.sleep_state == agent_pb2.ENGINE_SLEEP_STATE_UNSPECIFIED


@pytest.mark.parametrize(("sleep", "expected"), [
    ("weights_offloaded", SleepState.WEIGHTS_OFFLOADED), ("discard_all", SleepState.DISCARD_ALL)])
def test_sleeping_vllm_is_not_idle(sleep, expected):
    snap = parse_prometheus_text(vllm_text(queue=(0, 0, 0), preempted=0, queries=0, hits=0,
                                           sleep=sleep), names=VLLM.metric_names)
    assert snap.sleep_state is expected


@pytest.mark.parametrize(("text", "reason"), [
    ('vllm:engine_sleep_state{engine="0",sleep_state="awake"} 2\n', SkipReason.OUT_OF_RANGE),
    ('vllm:num_preemptions_total{engine="0"} -3\n', SkipReason.NEGATIVE),
    ('vllm:prefix_cache_hits_total{engine="0"} NaN\n'
     'vllm:prefix_cache_queries_total{engine="0"} 4\n', SkipReason.NON_FINITE),
    ('vllm:cache_config_info{engine="0",num_gpu_blocks="0"} 1\n', SkipReason.OUT_OF_RANGE),
])
def test_hostile_signal_values_refuse_the_scrape(text, reason):
    snap = parse_prometheus_text("vllm:num_requests_running 1\n" + text, names=VLLM.metric_names)
    assert reason in {skip.reason for skip in snap.skips}
    calc = RateCalculator()
    sample = calc.update(snap, now=0.0)
    assert sample.refused and not sample.metrics_present


def test_kv_blocks_used_above_total_is_refused():
    text = ("trtllm_kv_cache_max_blocks{model_name=\"m\"} 10\n"
            "trtllm_kv_cache_used_blocks{model_name=\"m\"} 11\n")
    snapshot, skips = read_engine_metrics("tensorrt-llm", {"/prometheus/metrics": text})
    assert any(s.reason is SkipReason.OUT_OF_RANGE for s in skips)
    assert snapshot is None or snapshot.kv_blocks_used is None


@needs_fixtures
def test_real_captures():
    vllm = parse_prometheus_text(
        (ENGINE_METRICS / "vllm-0.11-metrics.txt").read_text(), names=VLLM.metric_names)
    assert vllm.queue_time is not None and vllm.prompt_length is not None
    assert vllm.generation_length is not None
    assert (vllm.preemptions, vllm.prefix_cache_hits, vllm.prefix_cache_queries) == (0, 0, 0)
    assert vllm.kv_blocks_total == 2452 and vllm.kv_blocks_used == 0
    assert vllm.sleep_state is None  # 0.11 predates vllm:engine_sleep_state
    trt = parse_trtllm_json(
        (ENGINE_METRICS / "trtllm-serve-1.0.0rc4-trt-backend-metrics-object.json").read_text())
    assert (trt.kv_blocks_total, trt.kv_blocks_used) == (22955, 3)
    assert (trt.prefix_cache_hits, trt.prefix_cache_queries) == (0, 2)
    sglang = parse_prometheus_text(
        (REPO / "tests/fixtures/engine-metrics/sglang-0.5-collector-derived-metrics.txt")
        .read_text(), names=SGLANG.metric_names)
    assert (sglang.kv_blocks_total, sglang.kv_blocks_used) == (160589, 30512)


def test_trtllm_json_block_reuse_is_an_interval_hit_rate():
    def body(reused: int, missed: int) -> str:
        return json.dumps([{"iter": 1, "numActiveRequests": 1, "kvCacheStats": {
            "maxNumBlocks": 100, "usedNumBlocks": 10, "reusedBlocks": reused,
            "missedBlocks": missed, "cacheHitRate": reused / max(1, reused + missed)}}])
    calc = RateCalculator()
    calc.update(read_engine_metrics("tensorrt-llm", {"/metrics": body(4, 3121)})[0], now=0.0)
    snapshot, _ = read_engine_metrics("tensorrt-llm", {"/metrics": body(34, 3131)})
    assert snapshot is not None
    sample = calc.update(snapshot, now=60.0)
    assert sample.prefix_cache_hit_rate == pytest.approx(30 / 40)
    assert (sample.kv_blocks_total, sample.kv_blocks_used) == (100, 10)


# --- the emulator, read back through the agent's scraper (real HTTP, port 0) ------------

@asynccontextmanager
async def serving(flavor: str, argv: list[str]) -> AsyncIterator[str]:
    state = make_state(parse_engine_argv(flavor, argv), FAST)
    runner = web.AppRunner(build_app(state), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    tasks = [asyncio.create_task(state.iterstats.run())] if state.iterstats else []
    try:
        yield f"http://{host}:{port}"
    finally:
        for task in tasks:
            task.cancel()
        await runner.cleanup()


SHARED = " ".join(f"w{i}" for i in range(64))  # two 32-token blocks


async def _two_shared_prompts(http: aiohttp.ClientSession, url: str, model: str) -> None:
    for _ in range(2):
        async with http.post(f"{url}/v1/completions",
                             json={"model": model, "prompt": SHARED, "max_tokens": 3}) as resp:
            assert resp.status == 200


def _trtllm_argv(tmp_path: Path) -> list[str]:
    path = tmp_path / "extra.yaml"
    path.write_text("enable_iter_perf_stats: true\nreturn_perf_metrics: true\n")
    return ["org/t", "--backend", "pytorch", "--config", str(path)]


@pytest.mark.parametrize("flavor", ["vllm", "tensorrt-llm", "sglang"])
async def test_emulator_signals_reach_the_report(flavor, tmp_path):
    argv = {"vllm": ["serve", "org/m", "--served-model-name", "m"],
            "tensorrt-llm": _trtllm_argv(tmp_path),
            "sglang": ["--model-path", "org/s", "--served-model-name", "m", "--enable-metrics"],
            }[flavor]
    model = "org/t" if flavor == "tensorrt-llm" else "m"
    async with serving(flavor, argv) as url, aiohttp.ClientSession() as http, \
            EngineScraper(flavor, url, session=http) as scraper:
        await scraper.scrape(now=1.0)
        await _two_shared_prompts(http, url, model)
        await asyncio.sleep(0.05)  # the iteration of the last token lands one step later
        sample = await scraper.scrape(now=61.0)
    assert sample.metrics_present, sample.reason
    # The second request found both blocks of the first: half of all queried tokens.
    assert sample.prefix_cache_hit_rate == pytest.approx(0.5)
    assert sample.kv_blocks_total and sample.kv_blocks_total > 0
    assert sample.kv_blocks_used is not None
    if flavor != "tensorrt-llm":  # its queue time is in the optional Prometheus text too
        assert sample.mean_prompt_tokens == pytest.approx(64.0)
    assert sample.queue_time.present and sample.queue_time.count == 2
    if flavor == "vllm":
        assert sample.preemptions_per_s == 0.0
        assert sample.sleep_state is SleepState.AWAKE
        assert sample.mean_generation_tokens == pytest.approx(3.0)


async def test_emulated_vllm_sleep_mode():
    async with serving("vllm", ["serve", "org/m", "--served-model-name", "m"]) as url, \
            aiohttp.ClientSession() as http, EngineScraper("vllm", url, session=http) as scraper:
        async with http.post(f"{url}/sleep", params={"level": "2"}) as resp:
            assert resp.status == 200
        async with http.get(f"{url}/is_sleeping") as resp:
            assert (await resp.json()) == {"is_sleeping": True}
        async with http.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
            assert resp.status == 503
        asleep = await scraper.scrape(now=1.0)
        async with http.post(f"{url}/wake_up") as resp:
            assert resp.status == 200
        awake = await scraper.scrape(now=2.0)
    assert asleep.sleep_state is SleepState.DISCARD_ALL
    assert awake.sleep_state is SleepState.AWAKE
