"""`LoadGenerator`'s closed loop against a real aiohttp server on loopback: how many
requests are in flight, what they carry, the pause between them, and its checks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from gearshift.devfleet.load import LoadGenerator, Target

ANSWER = {"choices": [{"text": "ok"}]}


@dataclass
class Seen:
    """What the server saw: bodies in arrival order, and the most at once."""

    bodies: list[dict[str, object]] = field(default_factory=list)
    inflight: int = 0
    most_inflight: int = 0


@contextlib.asynccontextmanager
async def completions_server(delay_s: float, status: int = 200) -> AsyncIterator[tuple[str, Seen]]:
    """An endpoint answering each completion after `delay_s`; yields its base URL."""
    seen = Seen()

    async def complete(request: web.Request) -> web.Response:
        seen.bodies.append(await request.json())
        seen.inflight += 1
        seen.most_inflight = max(seen.most_inflight, seen.inflight)
        try:
            await asyncio.sleep(delay_s)
        finally:
            seen.inflight -= 1
        return web.Response(status=status, text=json.dumps(ANSWER),
                            content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def test_workers_bound_the_requests_in_flight_and_send_what_they_are_given() -> None:
    async with completions_server(delay_s=0.05) as (url, seen):
        load = LoadGenerator.closed_loop(url, ["m"], 3, stream_share=0.0, prompt="hi",
                                         max_tokens=8)
        await load.run_for(0.5)
    assert seen.most_inflight == 3
    assert load.sent == len(seen.bodies) >= 3 * 5  # about 0.5 s / 0.05 s each
    assert load.failed == 0 and load.errors == []
    assert all(b == {"model": "m", "prompt": "hi", "stream": False, "max_tokens": 8}
               for b in seen.bodies)


async def test_each_worker_pauses_after_an_answer() -> None:
    async with completions_server(delay_s=0.0) as (url, seen):
        load = LoadGenerator.closed_loop(url, ["m"], 2, pause_s=0.1, stream_share=0.0)
        started = time.monotonic()
        await load.run_for(0.45)
        took = time.monotonic() - started
    # Each worker sends at 0, 0.1, 0.2, 0.3, 0.4 s: at most 5 apiece, however fast the answers.
    assert 2 * 3 <= load.sent == len(seen.bodies) <= 2 * 5
    assert took < 0.45 + 0.2  # a stop ends the pause at once


async def test_every_target_gets_its_own_workers() -> None:
    async with completions_server(delay_s=0.02) as (url, seen):
        load = LoadGenerator([Target(url, "a"), Target(url, "b")], workers=2,
                             stream_share=0.0)
        await load.run_for(0.3)
    models = [b["model"] for b in seen.bodies]
    assert seen.most_inflight == 4
    assert models.count("a") > 0 and models.count("b") > 0


async def test_a_failed_answer_is_counted_and_the_worker_goes_on() -> None:
    async with completions_server(delay_s=0.0, status=503) as (url, seen):
        load = LoadGenerator.closed_loop(url, ["m"], 1, pause_s=0.05, stream_share=0.0)
        await load.run_for(0.3)
    assert load.sent == load.failed == len(seen.bodies) >= 2
    assert load.errors[0].startswith("m: HTTP 503")


def test_from_synchronous_code_it_stops_with_its_requests_answered() -> None:
    async def serve_then_load() -> tuple[LoadGenerator, Seen]:
        async with completions_server(delay_s=0.05) as (url, seen):
            load = LoadGenerator.closed_loop(url, ["m"], 2, pause_s=0.01, stream_share=0.0)
            await asyncio.to_thread(_run_briefly, load)
            return load, seen

    load, seen = asyncio.run(serve_then_load())
    assert load.sent == len(seen.bodies) > 0 and load.failed == 0


def _run_briefly(load: LoadGenerator) -> None:
    with load:
        time.sleep(0.3)


def test_a_closed_loop_needs_workers_and_has_no_rate() -> None:
    with pytest.raises(ValueError, match="0 worker"):
        LoadGenerator.closed_loop("http://127.0.0.1:1", ["m"], 0)
    with pytest.raises(ValueError, match="pause -1"):
        LoadGenerator.closed_loop("http://127.0.0.1:1", ["m"], 1, pause_s=-1)
    with pytest.raises(ValueError, match="no rate"):
        LoadGenerator.closed_loop("http://127.0.0.1:1", ["m"], 1).set_rate("m", 2.0)
    with pytest.raises(ValueError, match="positive rate"):
        LoadGenerator([Target("http://127.0.0.1:1", "m")])  # the open loop still needs one
