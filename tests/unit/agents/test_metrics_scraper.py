"""EngineScraper over real HTTP on 127.0.0.1 against an aiohttp server serving captured formats."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from fixture_paths import ENGINE_METRICS
from gearshift.agents.metrics import EngineScraper, SkipReason, to_proto
from gearshift.common.engines import ENGINE_NAMES
from gearshift.common.errors import InvalidArgument
from gearshift.v1 import agent_pb2

VLLM_BEFORE = (
    "# TYPE vllm:request_success_total counter\n"
    'vllm:request_success_total{finished_reason="stop",model_name="m"} 10\n'
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{model_name="m"} 2\n'
)
VLLM_AFTER = VLLM_BEFORE.replace("} 10\n", "} 30\n")


def _fixtures() -> Path:
    return ENGINE_METRICS


@dataclass
class FakeEngine:
    """Routes answer with whatever the test puts in `bodies` (path -> (status, body))."""

    bodies: dict[str, tuple[int, str]] = field(default_factory=dict)
    hold: bool = False  # answer only once `release` is set (a hung engine)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    hits: list[str] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        self.hits.append(request.path)
        if self.hold:
            await self.release.wait()
        status, body = self.bodies.get(request.path, (404, "not found"))
        return web.Response(status=status, text=body)


@pytest.fixture
async def engine() -> AsyncIterator[tuple[FakeEngine, str]]:
    fake = FakeEngine()
    app = web.Application()
    app.router.add_get("/{tail:.*}", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield fake, f"http://{host}:{port}"
    finally:
        fake.release.set()
        await runner.cleanup()


def _skipped(registry: CollectorRegistry, engine: str, reason: SkipReason) -> float:
    value = registry.get_sample_value(
        "gearshift_agent_metric_samples_skipped_total",
        {"engine": engine, "reason": reason.value},
    )
    return value or 0.0


ScraperFactory = Callable[..., EngineScraper]


@pytest.fixture
async def make_scraper() -> AsyncIterator[ScraperFactory]:
    made: list[EngineScraper] = []

    def make(*args: object, **kwargs: object) -> EngineScraper:
        scraper = EngineScraper(*args, **kwargs)  # type: ignore[arg-type]
        made.append(scraper)
        return scraper

    yield make
    for scraper in made:
        await scraper.close()


async def test_vllm_two_scrapes_give_rates(
    engine: tuple[FakeEngine, str], make_scraper: ScraperFactory
) -> None:
    fake, url = engine
    registry = CollectorRegistry()
    scraper = make_scraper("vllm", url + "/", registry=registry)
    fake.bodies["/metrics"] = (200, VLLM_BEFORE)
    first = await scraper.scrape(now=10.0)
    assert not first.metrics_present and first.running_requests == 2
    fake.bodies["/metrics"] = (200, VLLM_AFTER)
    second = await scraper.scrape(now=20.0)
    assert second.metrics_present
    assert second.request_rate == pytest.approx(2.0)
    assert fake.hits == ["/metrics", "/metrics"]
    assert _skipped(registry, "vllm", SkipReason.UNPARSEABLE) == 0


async def test_vllm_real_capture_over_http(
    engine: tuple[FakeEngine, str], make_scraper: ScraperFactory
) -> None:
    capture = _fixtures() / "vllm-0.11-metrics.txt"
    if not capture.is_file():
        pytest.skip(f"engine metric fixtures not found at {capture.parent}")
    fake, url = engine
    fake.bodies["/metrics"] = (200, capture.read_text(encoding="utf-8"))
    async with aiohttp.ClientSession() as session:
        scraper = make_scraper("vllm", url, session=session, registry=CollectorRegistry())
        await scraper.scrape(now=1.0)
        sample = await scraper.scrape(now=2.0)
        await scraper.close()
        assert not session.closed  # a session passed in stays the caller's
    assert sample.metrics_present
    assert sample.request_rate == 0.0
    assert not sample.ttft.present  # an idle server: no request in the interval
    assert sample.skips == ()


async def test_trtllm_json_only_when_prometheus_is_not_enabled(
    engine: tuple[FakeEngine, str], make_scraper: ScraperFactory
) -> None:
    fake, url = engine
    registry = CollectorRegistry()
    scraper = make_scraper("tensorrt-llm", url, registry=registry)
    iteration = {"numActiveRequests": 5, "numQueuedRequests": 1, "numCompletedRequests": 0,
                 "kvCacheStats": {"usedNumBlocks": 50, "maxNumBlocks": 200}}  # fmt: skip
    fake.bodies["/metrics"] = (200, json.dumps([iteration]))
    await scraper.scrape(now=0.0)
    fake.bodies["/metrics"] = (200, json.dumps([dict(iteration, numCompletedRequests=8)]))
    sample = await scraper.scrape(now=4.0)
    assert sample.metrics_present
    assert sample.request_rate == pytest.approx(2.0)
    assert (sample.running_requests, sample.waiting_requests) == (5, 1)
    assert sample.kv_cache_usage == pytest.approx(0.25)
    assert sorted(set(fake.hits)) == ["/metrics", "/prometheus/metrics"]
    assert _skipped(registry, "tensorrt-llm", SkipReason.HTTP_STATUS) == 0  # 404 = not enabled
    fake.bodies["/metrics"] = (200, "[]")  # drained, nothing ran: no samples, still a result
    idle = await scraper.scrape(now=8.0)
    assert idle.metrics_present and idle.request_rate == 0.0


async def test_trtllm_prometheus_counters_and_json_gauges(
    engine: tuple[FakeEngine, str], make_scraper: ScraperFactory
) -> None:
    fake, url = engine
    scraper = make_scraper("tensorrt-llm", url, registry=CollectorRegistry())
    text = (
        "# TYPE request_success_total counter\n"
        'request_success_total{{model_name="undefined",finished_reason="stop"}} {n}\n'
        "# TYPE e2e_request_latency_seconds histogram\n"
        'e2e_request_latency_seconds_bucket{{le="1.0"}} {n}\n'
        'e2e_request_latency_seconds_bucket{{le="+Inf"}} {n}\n'
        "e2e_request_latency_seconds_sum {s}\n"
        "e2e_request_latency_seconds_count {n}\n"
    )
    fake.bodies["/prometheus/metrics"] = (200, text.format(n=0, s=0.0))
    fake.bodies["/metrics"] = (200, json.dumps([{"numActiveRequests": 9}]))
    await scraper.scrape(now=0.0)
    fake.bodies["/prometheus/metrics"] = (200, text.format(n=10, s=5.0))
    sample = await scraper.scrape(now=5.0)
    assert sample.request_rate == pytest.approx(2.0)
    assert sample.e2e.present and sample.e2e.count == 10
    assert sample.e2e.mean_s == pytest.approx(0.5)
    assert sample.e2e.p50_s == pytest.approx(0.5)
    assert sample.running_requests == 9


async def test_connection_refused_is_a_sample_not_an_exception(
    make_scraper: ScraperFactory,
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    registry = CollectorRegistry()
    for engine_name in ENGINE_NAMES:
        scraper = make_scraper(engine_name, f"http://127.0.0.1:{port}", registry=registry)
        sample = await scraper.scrape(now=1.0)
        assert not sample.metrics_present
        assert f"127.0.0.1:{port}" in sample.reason
        assert [skip.reason for skip in sample.skips] == [SkipReason.UNREACHABLE]
        assert _skipped(registry, engine_name, SkipReason.UNREACHABLE) == 1


async def test_timeout_is_unreachable(
    engine: tuple[FakeEngine, str], make_scraper: ScraperFactory
) -> None:
    fake, url = engine
    fake.hold = True
    fake.bodies["/metrics"] = (200, VLLM_BEFORE)
    scraper = make_scraper("vllm", url, timeout_s=0.05, registry=CollectorRegistry())
    sample = await scraper.scrape(now=1.0)
    assert not sample.metrics_present
    assert "timed out" in sample.reason


async def test_bad_bodies_and_statuses_are_counted_by_reason(
    engine: tuple[FakeEngine, str], make_scraper: ScraperFactory
) -> None:
    fake, url = engine
    registry = CollectorRegistry()
    vllm = make_scraper("vllm", url, registry=registry)
    fake.bodies["/metrics"] = (200, "<html>oops</html>")
    garbage = await vllm.scrape(now=1.0)
    assert not garbage.metrics_present and "not Prometheus text at line 1" in garbage.reason
    fake.bodies["/metrics"] = (503, "engine dead")
    dead = await vllm.scrape(now=2.0)
    assert "HTTP 503" in dead.reason
    fake.bodies["/metrics"] = (200, "# TYPE python_info gauge\npython_info 1\n")
    unknown = await vllm.scrape(now=3.0)
    assert "no vllm: metric" in unknown.reason
    fake.bodies["/metrics"] = (200, VLLM_BEFORE.replace("} 2\n", "} NaN\n"))
    nan = await vllm.scrape(now=4.0)
    assert nan.running_requests == 0.0
    assert _skipped(registry, "vllm", SkipReason.UNPARSEABLE) == 1
    assert _skipped(registry, "vllm", SkipReason.HTTP_STATUS) == 1
    assert _skipped(registry, "vllm", SkipReason.MISSING_FAMILY) == 1
    assert _skipped(registry, "vllm", SkipReason.NON_FINITE) == 1

    trt = make_scraper("tensorrt-llm", url, registry=registry)
    fake.bodies["/metrics"] = (200, '{"numActiveRequests": 1 ...')
    bad_json = await trt.scrape(now=1.0)
    assert not bad_json.metrics_present and "not valid JSON" in bad_json.reason
    assert _skipped(registry, "tensorrt-llm", SkipReason.UNPARSEABLE) == 1


async def test_counter_reset_is_counted(
    engine: tuple[FakeEngine, str], make_scraper: ScraperFactory
) -> None:
    fake, url = engine
    registry = CollectorRegistry()
    scraper = make_scraper("vllm", url, registry=registry)
    fake.bodies["/metrics"] = (200, VLLM_AFTER)
    await scraper.scrape(now=1.0)
    fake.bodies["/metrics"] = (200, VLLM_BEFORE)
    sample = await scraper.scrape(now=2.0)
    assert sample.counter_reset and sample.request_rate == pytest.approx(10.0)
    resets = registry.get_sample_value(
        "gearshift_agent_metric_counter_resets_total", {"engine": "vllm"}
    )
    assert resets == 1


def test_constructor_rejects_unknown_engine_and_bad_url() -> None:
    with pytest.raises(InvalidArgument,
                       match=f"unknown engine 'tgi'; known: {', '.join(ENGINE_NAMES)}"):
        EngineScraper("tgi", "http://127.0.0.1:1")
    with pytest.raises(InvalidArgument, match="http://"):
        EngineScraper("vllm", "127.0.0.1:8000")
    with pytest.raises(InvalidArgument, match="timeout_s"):
        EngineScraper("vllm", "http://127.0.0.1:1", timeout_s=0)


def test_two_scrapers_share_one_metrics_container_per_registry() -> None:
    registry = CollectorRegistry()
    EngineScraper("vllm", "http://127.0.0.1:1", registry=registry)
    EngineScraper("tensorrt-llm", "http://127.0.0.1:2", registry=registry)  # no duplicate error


def _two_processes(first: str, second: str, kv: str = "0.5") -> str:
    """A vLLM body with two engine processes (data parallel) behind one endpoint."""
    return "\n".join([
        "# TYPE vllm:request_success_total counter",
        f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="m"}} {first}',
        f'vllm:request_success_total{{engine="1",finished_reason="stop",model_name="m"}} {second}',
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 1',
        'vllm:num_requests_running{engine="1",model_name="m"} 1',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}',
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5',
        "",
    ])


async def test_one_process_restarting_never_spikes_the_rate(
    engine: tuple[FakeEngine, str], make_scraper: ScraperFactory
) -> None:
    fake, url = engine
    scraper = make_scraper("vllm", url, registry=CollectorRegistry())
    fake.bodies["/metrics"] = (200, _two_processes("50000", "100000"))
    await scraper.scrape(now=0.0)
    fake.bodies["/metrics"] = (200, _two_processes("0", "100001"))  # process 0 restarted
    sample = await scraper.scrape(now=1.0)
    assert sample.metrics_present and sample.counter_reset
    assert sample.request_rate == pytest.approx(1.0)  # not 100,001
    report = agent_pb2.DeploymentReport()
    to_proto(sample, report)
    assert report.partial_interval and report.request_rate == pytest.approx(1.0)
    fake.bodies["/metrics"] = (200, _two_processes("3", "100003"))
    steady = await scraper.scrape(now=2.0)
    assert steady.request_rate == pytest.approx(5.0) and not steady.counter_reset


@pytest.mark.parametrize(("first", "kv", "reason"), [
    ("NaN", "0.5", SkipReason.NON_FINITE),
    ("100", "NaN", SkipReason.NON_FINITE),
    ("100", "+Inf", SkipReason.NON_FINITE),
    ("100", "1.5", SkipReason.OUT_OF_RANGE),
    ("100", "-0.5", SkipReason.NEGATIVE),
])
async def test_broken_values_refuse_the_scrape_and_are_counted(
    engine: tuple[FakeEngine, str], make_scraper: ScraperFactory, first: str, kv: str,
    reason: SkipReason,
) -> None:
    fake, url = engine
    registry = CollectorRegistry()
    scraper = make_scraper("vllm", url, registry=registry)
    fake.bodies["/metrics"] = (200, _two_processes("90", "100"))
    await scraper.scrape(now=0.0)
    fake.bodies["/metrics"] = (200, _two_processes(first, "110", kv=kv))
    broken = await scraper.scrape(now=1.0)
    assert not broken.metrics_present and broken.refused
    assert broken.request_rate == 0 and "scrape refused" in broken.reason
    report = agent_pb2.DeploymentReport()
    to_proto(broken, report)
    assert not report.metrics_present and report.partial_interval
    assert _skipped(registry, "vllm", reason) >= 1
    refused = registry.get_sample_value("gearshift_agent_metric_scrapes_refused_total",
                                        {"engine": "vllm"})
    assert refused == 1
    # The next good scrape measures from the last good one: the interval is just longer.
    fake.bodies["/metrics"] = (200, _two_processes("100", "120"))
    after = await scraper.scrape(now=2.0)
    assert after.metrics_present and after.request_rate == pytest.approx(15.0)
