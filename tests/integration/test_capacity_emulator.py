"""The capacity model fed the way the agent feeds it: a real emulated engine under load,
scraped over HTTP by `EngineScraper`, each interval one `LoadObservation`.

Checks the pipeline, not the accuracy (that is bench/capacity.py's job): the
scraped intervals are accepted, the fit is monotone, and the estimate is a
state with a reason rather than an exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from gearshift.agents.metrics import EngineScraper
from gearshift.devfleet.local_fleet import spawn
from gearshift.devfleet.ports import free_port
from gearshift.policies.capacity import CapacityKey, CapacityModel, LoadObservation

CAPACITY_RPS = 20.0
LEVELS = (0.3, 0.6, 1.3)      # fractions of the capacity
LEVEL_S = 2.0
INTERVAL_S = 0.4


@pytest.fixture
def engine_url(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    engine = spawn(
        "engine",
        [sys.executable, "-m", "gearshift.agents.emulator", "--flavor", "vllm",
         "--capacity-rps", str(CAPACITY_RPS), "--load-s", "0", "--", "serve", "m",
         "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m"],
        tmp_path)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        engine.terminate()


async def _ready(session: aiohttp.ClientSession, url: str) -> None:
    for _ in range(300):
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with session.get(url + "/health") as response:
                if response.status == 200:
                    return
        await asyncio.sleep(0.05)
    raise AssertionError(f"emulator at {url} never became ready")


async def test_scraped_intervals_feed_the_capacity_model(engine_url: str) -> None:
    model = CapacityModel(CapacityKey("m", "vllm", "emulated", "cpu"))
    pending: set[asyncio.Task[None]] = set()

    async def request(session: aiohttp.ClientSession) -> None:
        with contextlib.suppress(aiohttp.ClientError):
            async with session.post(engine_url + "/v1/completions",
                                    json={"model": "m", "prompt": "hi"}) as response:
                await response.read()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await _ready(session, engine_url)
        async with EngineScraper("vllm", engine_url) as scraper:
            loop = asyncio.get_running_loop()
            await scraper.scrape(loop.time())
            for level in LEVELS:
                gap_s = 1.0 / (level * CAPACITY_RPS)
                for tick in range(round(LEVEL_S / INTERVAL_S)):
                    for _ in range(round(INTERVAL_S / gap_s)):
                        task = asyncio.create_task(request(session))
                        pending.add(task)
                        task.add_done_callback(pending.discard)
                        await asyncio.sleep(gap_s)
                    sample = await scraper.scrape(loop.time())
                    if tick and sample.metrics_present:
                        model.add(LoadObservation(
                            loop.time(), sample.request_rate,
                            sample.ttft.p99_s if sample.ttft.present else None,
                            sample.itl.p99_s if sample.itl.present else None))
        for task in list(pending):
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    assert len(model) >= 6, model.rejected
    assert all(o.ttft_p99_s is not None and o.ttft_p99_s > 0 for o in model.observations())
    fitted = [p.fitted_p99_s for p in model.curve("ttft")]
    assert fitted == sorted(fitted)
    estimate = model.estimate(sla_ttft_p99_s=1.0)
    assert estimate.status in ("ok", "lower_bound", "upper_bound", "insufficient_data")
    if estimate.status == "insufficient_data":
        assert estimate.reason
    else:
        assert estimate.capacity_rps is not None and estimate.capacity_rps > 0
    restored = CapacityModel.from_dict(model.to_dict())
    assert restored.estimate(sla_ttft_p99_s=1.0) == estimate
