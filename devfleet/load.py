"""The load generator of development fleets: clients of OpenAI-compatible endpoints.

One `LoadGenerator` serves the demo (async, rates changed while it runs), the
integration tests (as a context manager that runs it on a thread of its own) and
any benchmark that needs realistic clients: per target (a base URL, the gateway's
or one engine's, and a model) Poisson arrivals at a rate, a share of them
streaming, every answer checked. A request fails when its status is not 200, the
connection breaks or times out, a stream ends without ``data: [DONE]``, or a
plain answer has no ``choices``. `bench/gateway.py` keeps its own lean keep-alive
client: it measures the gateway's added latency per request and must leave the
cores to the processes under test, which this general client does not try to.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

PROMPT = "Explain continuous batching."
MAX_TOKENS = 16
REQUEST_TIMEOUT_S = 60.0
CONNECTIONS = 256  # the client pool's limit across all targets
ERRORS_KEPT = 20  # failures kept with their reason (all are counted)
STOP_JOIN_S = 70.0  # a stopping thread waits for requests in flight (their timeout)


@dataclass(frozen=True)
class Target:
    """Where to send one model's requests, and how many per second."""

    base_url: str  # e.g. "http://127.0.0.1:8080" (the gateway) or an engine's endpoint
    model: str
    rps: float


class LoadGenerator:
    """Clients of `targets`; `sent`, `failed` and the first `errors` say what happened."""

    def __init__(self, targets: Sequence[Target], *, stream_share: float = 0.5,
                 max_tokens: int = MAX_TOKENS, seed: int | None = None) -> None:
        if not targets or any(t.rps <= 0 for t in targets):
            raise ValueError("load: need at least one target, each with a positive rate")
        self.targets = list(targets)
        self.stream_share = stream_share
        self.max_tokens = max_tokens
        self.sent = 0
        self.failed = 0
        self.errors: list[str] = []
        self._rng = random.Random(seed)
        self._rates = {i: t.rps for i, t in enumerate(self.targets)}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    @classmethod
    def gateway(cls, url: str, rates: dict[str, float], **kw: object) -> LoadGenerator:
        """Clients of one gateway, `rates` requests/s per model."""
        return cls([Target(url, m, r) for m, r in rates.items()], **kw)  # type: ignore[arg-type]

    def set_rate(self, model: str, rps: float) -> None:
        """Change the rate of every target of `model` (takes effect at the next arrival)."""
        for i, t in enumerate(self.targets):
            if t.model == model:
                self._rates[i] = rps

    # -- async use ----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Send until `stop` is set, then wait for the requests in flight."""
        connector = aiohttp.TCPConnector(limit=CONNECTIONS)
        async with aiohttp.ClientSession(connector=connector) as session:
            await asyncio.gather(*(self._target_loop(session, i, stop)
                                   for i in range(len(self.targets))))

    async def _target_loop(self, session: aiohttp.ClientSession, i: int, stop: asyncio.Event) -> None:
        inflight: set[asyncio.Task[None]] = set()
        target = self.targets[i]
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self._rng.expovariate(self._rates[i]))
                break
            except TimeoutError:
                pass
            stream = self._rng.random() < self.stream_share
            task = asyncio.create_task(self._one(session, target, stream))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
        await asyncio.gather(*inflight, return_exceptions=True)

    async def _one(self, session: aiohttp.ClientSession, target: Target, stream: bool) -> None:
        self.sent += 1
        body = {"model": target.model, "prompt": PROMPT, "max_tokens": self.max_tokens,
                "stream": stream}
        try:
            async with session.post(f"{target.base_url}/v1/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as resp:
                data = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._fail(f"{target.model}: {type(exc).__name__}: {exc}")
            return
        if resp.status != 200:
            self._fail(f"{target.model}: HTTP {resp.status} {data[:120]!r}")
        elif stream and b"data: [DONE]" not in data:
            self._fail(f"{target.model}: truncated stream {data[-120:]!r}")
        elif not stream and b'"choices"' not in data:
            self._fail(f"{target.model}: no choices in {data[:120]!r}")

    def _fail(self, why: str) -> None:
        self.failed += 1
        if len(self.errors) < ERRORS_KEPT:
            self.errors.append(why)

    # -- from synchronous code ------------------------------------------------------------

    def __enter__(self) -> LoadGenerator:
        started = threading.Event()

        def main() -> None:
            async def body() -> None:
                self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
                started.set()
                await self.run(self._stop)
            asyncio.run(body())

        self._thread = threading.Thread(target=main, name="load", daemon=True)
        self._thread.start()
        started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(STOP_JOIN_S)


__all__ = ["LoadGenerator", "Target"]
