"""The operators' listener against hostile clients: slow heads, one crowded source, and
hundreds of slow connections that must not starve `/healthz`. Real sockets over loopback;
Linux routes all of 127.0.0.0/8 to loopback, so 127.0.0.N stand for other hosts."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import random
import resource
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from prometheus_client import CollectorRegistry

from gearshift.common.ops_http import (
    HEAD_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS_PER_SOURCE,
    OpsLimits,
    OpsListener,
)

pytestmark = pytest.mark.timeout(60)

SLOW_CLIENTS = 500
ATTACK_SOURCES = 32  # 500 / 32 < 16: within the per-source limit, so the global cap is what is hit
PROBE_DEADLINE_S = 1.0
PATIENT = {"head_timeout_s": 30.0, "idle_timeout_s": 30.0}  # no deadline fires mid-test
FDS_NEEDED = 2 * SLOW_CLIENTS + 200  # both ends of each connection live in this process


@contextlib.asynccontextmanager
async def listening(limits: OpsLimits | None = None) -> AsyncIterator[int]:
    ops = OpsListener(CollectorRegistry(), ready=lambda: True, limits=limits)
    port = await ops.start("127.0.0.1", 0)
    try:
        yield port
    finally:
        await ops.stop()


@contextlib.asynccontextmanager
async def connected(port: int, source: str = "127.0.0.1",
                    ) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes | None:
    """All the server sent before it closed, or None if it is still open after `seconds`."""
    try:
        return await asyncio.wait_for(reader.read(), seconds)
    except TimeoutError:
        return None
    except ConnectionError:
        return b""


async def probe(port: int, path: bytes = b"/healthz") -> tuple[bytes, float]:
    """A kubelet-like probe from 127.0.0.1: (status line, seconds it took)."""
    began = time.monotonic()
    try:
        async with connected(port) as (reader, writer):
            writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: probe\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), PROBE_DEADLINE_S * 5)
    except (OSError, TimeoutError) as err:
        answer = repr(err).encode()
    return answer.split(b"\r\n", 1)[0], time.monotonic() - began


@pytest.fixture
def enough_files() -> Iterator[None]:
    """Raise the soft open-files limit for the test (as the benches do), then put it back."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= FDS_NEEDED:
        yield
        return
    if hard != resource.RLIM_INFINITY and hard < FDS_NEEDED:
        pytest.skip(f"needs {FDS_NEEDED} open files, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (FDS_NEEDED, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_healthz_answers_within_a_second_while_500_slow_clients_hold_on(
        enough_files: None) -> None:
    stop = asyncio.Event()
    stats = {"connects": 0, "cut": 0}
    rnd = random.Random(7)

    async def slow_client(source: str, port: int) -> None:
        """Sends one byte every half second; reconnects a moment after being closed."""
        while not stop.is_set():
            try:
                async with connected(port, source) as (reader, writer):
                    stats["connects"] += 1
                    writer.write(b"G")
                    while not stop.is_set():
                        if await closed_within(reader, 0.5) is not None:
                            stats["cut"] += 1
                            break
                        writer.write(b"E")
            except OSError:
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), rnd.uniform(0.3, 0.8))

    async with listening() as port:
        sources = [f"127.0.0.{2 + i % ATTACK_SOURCES}" for i in range(SLOW_CLIENTS)]
        clients = [asyncio.create_task(slow_client(s, port)) for s in sources]
        try:
            while stats["connects"] < SLOW_CLIENTS:  # the first wave is in
                await asyncio.sleep(0.05)
            answers = []
            for _ in range(8):  # over about 2.5 s of the attack, waves of reconnects included
                answers.append(await probe(port))
                await asyncio.sleep(0.3)
            assert all(status == b"HTTP/1.1 200 OK" for status, _ in answers), answers
            assert max(took for _, took in answers) < PROBE_DEADLINE_S, answers
            status, took = await probe(port, b"/readyz")
            assert status == b"HTTP/1.1 200 OK" and took < PROBE_DEADLINE_S
            assert stats["cut"] > SLOW_CLIENTS // 2  # the listener was full and shed them
        finally:
            stop.set()
            await asyncio.gather(*clients, return_exceptions=True)


async def test_a_slow_head_is_cut_at_the_deadline_and_a_silent_one_at_the_idle_limit() -> None:
    assert IDLE_TIMEOUT_S <= HEAD_TIMEOUT_S <= 5.0  # the production defaults stay short
    limits = OpsLimits(head_timeout_s=0.6, idle_timeout_s=0.4)
    async with listening(limits) as port, connected(port) as (trickle, writer), \
            connected(port) as (silent, _):
        began = time.monotonic()
        for byte in b"GET /healthz HTTP/1.1\r\n":  # a byte every 0.1 s: never idle
            writer.write(bytes([byte]))
            if (answer := await closed_within(trickle, 0.1)) is not None:
                break
        else:
            answer = await closed_within(trickle, 2.0)
        took = time.monotonic() - began
        assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer
        assert 0.35 <= took < 2.0, took  # production: HEAD_TIMEOUT_S, not the original 5 s
        cut = await closed_within(silent, 0.1)  # long since cut by the idle limit
        assert cut is not None and cut.startswith(b"HTTP/1.1 408"), cut
        assert (await probe(port))[0] == b"HTTP/1.1 200 OK"


async def test_connections_beyond_the_per_source_limit_are_closed_at_once() -> None:
    await _per_source_scenario()


async def _per_source_scenario() -> None:
    async with listening(OpsLimits(**PATIENT)) as port, contextlib.AsyncExitStack() as held:
        crowd = [await held.enter_async_context(connected(port, "127.0.0.7"))
                 for _ in range(MAX_CONNECTIONS_PER_SOURCE)]
        for _, writer in crowd:
            writer.write(b"GET /metrics HTTP/1.1\r\n")  # heads in progress
        async with connected(port, "127.0.0.7") as (reader, _):
            answer = await closed_within(reader, 1.0)
        assert answer is not None and answer.startswith(b"HTTP/1.1 503"), answer
        assert answer.endswith(b"too many connections from this address\n")
        assert all(await asyncio.gather(*(  # the first ones were left alone
            _still_open(reader) for reader, _ in crowd)))
        assert (await probe(port))[0] == b"HTTP/1.1 200 OK"  # other sources are served
        reader, writer = crowd[0]
        writer.write(b"\r\n")  # one of the crowd finishes its head and is answered ...
        assert (await closed_within(reader, 1.0) or b"").startswith(b"HTTP/1.1 200")
        await asyncio.sleep(0.05)
        async with connected(port, "127.0.0.7") as (reader, writer):  # ... freeing a slot
            writer.write(b"GET /healthz HTTP/1.1\r\n\r\n")
            assert (await closed_within(reader, 1.0) or b"").startswith(b"HTTP/1.1 200")


async def _still_open(reader: asyncio.StreamReader) -> bool:
    return await closed_within(reader, 0.1) is None


async def test_a_full_listener_evicts_the_oldest_head_of_the_most_crowded_source() -> None:
    await _eviction_scenario()


async def _eviction_scenario() -> None:
    limits = OpsLimits(max_connections=4, max_per_source=3, **PATIENT)
    async with listening(limits) as port, contextlib.AsyncExitStack() as held:
        crowd = [await held.enter_async_context(connected(port, "127.0.0.8"))
                 for _ in range(3)]
        lone_reader, lone_writer = await held.enter_async_context(connected(port, "127.0.0.9"))
        for _, writer in [*crowd, (lone_reader, lone_writer)]:
            writer.write(b"GET /readyz HTTP/1.1\r\n")
        await asyncio.sleep(0.05)  # the listener now holds 4 heads in progress: it is full
        status, took = await probe(port)
        assert status == b"HTTP/1.1 200 OK" and took < PROBE_DEADLINE_S
        evicted = await closed_within(crowd[0][0], 1.0)
        assert evicted is not None and evicted.startswith(b"HTTP/1.1 503")
        assert await _still_open(lone_reader)  # a lone source is the last to lose a slot
        assert all([await _still_open(reader) for reader, _ in crowd[1:]])


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop not installed")
def test_the_same_limits_hold_on_uvloop() -> None:
    """The daemons run on uvloop (gearshift.common.event_loop), whose transports differ."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_per_source_scenario())
        runner.run(_eviction_scenario())
