"""The emulator's HTTP surface over real loopback HTTP (in-process server, port 0)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from fixture_paths import ENGINE_METRICS
from gearshift.agents.emulator.app import build_app
from gearshift.agents.emulator.args import parse_engine_argv
from gearshift.agents.emulator.config import EmulatorOptions
from gearshift.agents.emulator.server import make_state

FIXTURES = ENGINE_METRICS
needs_fixtures = pytest.mark.skipif(not FIXTURES.is_dir(),
                                    reason=f"engine metric fixtures not found at {FIXTURES}")
FAST = EmulatorOptions(capacity_rps=40.0, load_s=0.0, ttft_base_s=0.002, itl_s=0.001,
                       output_tokens=4, engine_version="9.9.9")


@asynccontextmanager
async def serving(flavor: str, argv: list[str], options: EmulatorOptions = FAST,
                  crashes: list[int] | None = None) -> AsyncIterator[tuple[str, object]]:
    state = make_state(parse_engine_argv(flavor, argv), options)
    if crashes is not None:
        state = replace(state, on_crash=lambda: crashes.append(1))
    runner = web.AppRunner(build_app(state), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    tasks = []
    if state.iterstats is not None:
        tasks.append(asyncio.create_task(state.iterstats.run()))
    try:
        yield f"http://{host}:{port}", state
    finally:
        for task in tasks:
            task.cancel()
        await runner.cleanup()


VLLM_ARGV = ["serve", "org/m", "--served-model-name", "m1"]


def _trtllm_argv(tmp_path: Path, config: str) -> list[str]:
    path = tmp_path / "extra.yaml"
    path.write_text(config)
    return ["org/t", "--backend", "pytorch", "--config", str(path)]


async def test_models_and_non_streaming_completions():
    async with serving("vllm", VLLM_ARGV) as (url, _), aiohttp.ClientSession() as http:
        async with http.get(f"{url}/v1/models") as resp:
            models = await resp.json()
        assert [m["id"] for m in models["data"]] == ["m1"]
        async with http.post(f"{url}/v1/completions",
                             json={"model": "m1", "prompt": "one two three", "max_tokens": 3}) as resp:
            body = await resp.json()
        assert resp.status == 200
        assert body["object"] == "text_completion" and body["model"] == "m1"
        assert body["choices"][0]["finish_reason"] == "length"
        assert len(body["choices"][0]["text"].split()) == 3
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
        async with http.post(f"{url}/v1/chat/completions",
                             json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
                             ) as resp:
            chat = await resp.json()
        assert chat["object"] == "chat.completion"
        assert chat["choices"][0]["message"]["role"] == "assistant"
        assert chat["choices"][0]["finish_reason"] == "stop"
        assert chat["usage"]["completion_tokens"] == FAST.output_tokens


async def test_streaming_chat_sends_sse_chunks_usage_and_done():
    request = {"model": "m1", "messages": [{"role": "user", "content": "hello there"}],
               "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    async with serving("vllm", VLLM_ARGV) as (url, _), aiohttp.ClientSession() as http, \
            http.post(f"{url}/v1/chat/completions", json=request) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    content = [c for c in chunks if c["choices"]]
    assert len(content) == 5
    assert content[0]["choices"][0]["delta"]["role"] == "assistant"
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}


@pytest.mark.parametrize(("body", "status", "needle"), [
    (b'{"model": "other", "prompt": "x"}', 404, "does not exist"),
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"model": "m1"}', 400, "prompt"),
    (b'{"model": "m1", "prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"model": "m1", "prompt": "x", "stream": "yes"}', 400, "stream"),
    (b'{"model": "m1", "prompt": {"a": 1}}', 400, "prompt"),
])
async def test_bad_requests_get_openai_style_errors(body, status, needle):
    async with serving("vllm", VLLM_ARGV) as (url, _), aiohttp.ClientSession() as http, \
            http.post(f"{url}/v1/completions", data=body,
                      headers={"Content-Type": "application/json"}) as resp:
        error = (await resp.json())["error"]
    assert resp.status == status
    assert error["code"] == status and needle in error["message"]


@needs_fixtures
async def test_vllm_metrics_use_real_names_labels_and_buckets():
    async with serving("vllm", VLLM_ARGV) as (url, _), aiohttp.ClientSession() as http:
        for _ in range(2):
            async with http.post(f"{url}/v1/completions",
                                 json={"model": "m1", "prompt": "a b", "max_tokens": 3}) as resp:
                await resp.read()
        async with http.get(f"{url}/metrics") as resp:
            text = await resp.text()
    ours = {f.name: f for f in text_string_to_metric_families(text)}
    real = {f.name: f for f in text_string_to_metric_families(
        (FIXTURES / "vllm-0.11-metrics.txt").read_text())}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens", "vllm:generation_tokens",
                 "vllm:request_success", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"):
        assert ours[name].type == real[name].type, name
        if ours[name].type == "histogram":
            def bounds(family):
                return [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]
            assert bounds(ours[name]) == bounds(real[name]), name
        for sample in ours[name].samples:
            assert sample.labels["model_name"] == "m1" and sample.labels["engine"] == "0"
    success = {s.labels["finished_reason"]: s.value for s in ours["vllm:request_success"].samples
               if s.name.endswith("_total")}
    assert success == {"stop": 0.0, "length": 2.0, "abort": 0.0}
    gen = [s.value for s in ours["vllm:generation_tokens"].samples if s.name.endswith("_total")]
    assert gen == [6.0]
    itl_count = [s.value for s in ours["vllm:inter_token_latency_seconds"].samples
                 if s.name.endswith("_count")]
    assert itl_count == [4.0]  # two requests, three tokens each, two gaps each
    info = ours["gearshift_emulator_info"].samples[0]
    assert info.labels == {"flavor": "vllm", "engine_version": "9.9.9"}


async def test_health_and_latency_faults_switch_at_run_time():
    crashes: list[int] = []
    async with serving("vllm", VLLM_ARGV, crashes=crashes) as (url, state), \
            aiohttp.ClientSession() as http:
        async with http.get(f"{url}/health") as resp:
            assert resp.status == 200
        async with http.post(f"{url}/emulator/faults",
                             json={"health": "fail", "latency_factor": 2.5}) as resp:
            assert resp.status == 200
        async with http.get(f"{url}/health") as resp:
            assert resp.status == 503
        async with http.get(f"{url}/emulator/state") as resp:
            snapshot = await resp.json()
        assert snapshot["faults"]["health"] == "fail"
        assert snapshot["faults"]["latency_factor"] == 2.5
        assert state.engine.latency_factor == 2.5
        async with http.post(f"{url}/emulator/faults", json={"bogus": 1}) as resp:
            assert resp.status == 400
            assert "bogus" in (await resp.json())["error"]["message"]
        async with http.post(f"{url}/emulator/faults", json={"crash": True}) as resp:
            assert resp.status == 200
        assert crashes == [1]
        async with http.get(f"{url}/version") as resp:
            assert (await resp.json()) == {"version": "9.9.9"}


async def test_draining_engine_rejects_new_requests():
    async with serving("vllm", VLLM_ARGV) as (url, state), aiohttp.ClientSession() as http:
        state.draining = True
        async with http.post(f"{url}/v1/completions", json={"model": "m1", "prompt": "x"}) as resp:
            assert resp.status == 503


@needs_fixtures
async def test_trtllm_json_metrics_are_drained_on_read(tmp_path):
    argv = _trtllm_argv(tmp_path, "enable_iter_perf_stats: true\nreturn_perf_metrics: true\n")
    async with serving("tensorrt-llm", argv) as (url, _), aiohttp.ClientSession() as http:
        async with http.get(f"{url}/health_generate") as resp:
            assert resp.status == 200
        async with http.post(f"{url}/v1/completions",
                             json={"model": "org/t", "prompt": "x y", "max_tokens": 4}) as resp:
            assert resp.status == 200
        for _ in range(100):  # the stats of the last iteration land one step later
            async with http.get(f"{url}/emulator/state") as resp:
                if (await resp.json())["running"] == 0:
                    break
        await asyncio.sleep(0.05)
        async with http.get(f"{url}/metrics") as resp:
            first = await resp.json()
        async with http.get(f"{url}/metrics") as resp:
            second = await resp.json()
    assert first and second == []
    fixture = json.loads((FIXTURES / "trtllm-serve-1.0.0rc4-trt-backend-metrics-object.json")
                         .read_text())
    assert set(first[0]) == set(fixture)
    assert set(first[0]["kvCacheStats"]) == set(fixture["kvCacheStats"])
    assert set(first[0]["inflightBatchingStats"]) == set(fixture["inflightBatchingStats"])
    assert sum(s["numCompletedRequests"] for s in first) == 1
    assert [s["iter"] for s in first] == sorted(s["iter"] for s in first)


@pytest.mark.parametrize(("options", "prefix"), [
    (FAST, "trtllm_"),
    (replace(FAST, trtllm_prefixed_names=False), ""),
])
async def test_trtllm_prometheus_names(tmp_path, options, prefix):
    argv = _trtllm_argv(tmp_path, "return_perf_metrics: true\n")
    async with serving("tensorrt-llm", argv, options) as (url, _), aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/completions",
                             json={"model": "org/t", "prompt": "x", "max_tokens": 2}) as resp:
            assert resp.status == 200
        async with http.get(f"{url}/prometheus/metrics") as resp:
            families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
        async with http.get(f"{url}/metrics") as resp:
            assert await resp.json() == []  # iteration stats were not enabled
    for name in ("request_success", "e2e_request_latency_seconds", "time_to_first_token_seconds",
                 "time_per_output_token_seconds", "request_queue_time_seconds"):
        family = families[prefix + name]
        assert all(s.labels["model_name"] == "org/t" and s.labels["engine_type"] == "pytorch"
                   for s in family.samples)
    count = [s.value for s in families[prefix + "e2e_request_latency_seconds"].samples
             if s.name.endswith("_count")]
    assert count == [1.0]


async def test_full_batch_makes_requests_wait():
    options = replace(FAST, max_batch=1, itl_s=0.01, output_tokens=5)
    async with serving("vllm", VLLM_ARGV, options) as (url, state), aiohttp.ClientSession() as http:
        async def one() -> None:
            async with http.post(f"{url}/v1/completions",
                                 json={"model": "m1", "prompt": "x"}) as resp:
                await resp.read()

        tasks = [asyncio.create_task(one()) for _ in range(3)]
        seen_waiting = 0
        while not all(t.done() for t in tasks):
            seen_waiting = max(seen_waiting, state.engine.waiting)
            assert state.engine.running <= 1
            await asyncio.sleep(0.002)
        await asyncio.gather(*tasks)
        async with http.get(f"{url}/metrics") as resp:
            families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    assert seen_waiting >= 1
    queue_sum = [s.value for s in families["vllm:request_queue_time_seconds"].samples
                 if s.name.endswith("_sum")]
    assert queue_sum[0] > 0
