"""The load generator of development fleets: clients of OpenAI-compatible endpoints.

One `LoadGenerator` serves the demo (async, rates changed while it runs), the
integration tests and the benches that send requests (bench/capacity.py,
bench/sla_queue_warning.py, bench/failover.py): per target (a base URL, the
gateway's or one engine's, and a model) Poisson arrivals at a rate, a share of them
streaming, every answer checked. It runs until told to stop (`run`), for a given
time (`run_for`), or on a thread of its own (as a context manager, from
synchronous code). Arrivals keep to their schedule: an arrival that a busy event
loop delays does not delay the ones after it.

With `workers=N` it is a closed loop instead (bench/failover.py): N workers per
target, each sending its next request when its last one has finished, after an
optional `pause_s`; the rate then follows the endpoint's latency, and the
targets' rates are unused. A request fails when its status is
not 200, the connection breaks or times out, a stream ends without
``data: [DONE]``, or a plain answer has no ``choices``. `bench/gateway.py` keeps
its own lean keep-alive client: it measures the gateway's added latency per
request and must leave the cores to the processes under test, which this general
client does not try to.
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
    rps: float = 0.0  # the open loop's Poisson rate; unused by a closed loop


class LoadGenerator:
    """Clients of `targets`; `sent`, `failed` and the first `errors` say what happened."""

    def __init__(self, targets: Sequence[Target], *, stream_share: float = 0.5,
                 max_tokens: int | None = MAX_TOKENS, prompt: str = PROMPT,
                 timeout_s: float = REQUEST_TIMEOUT_S, seed: int | None = None,
                 workers: int | None = None, pause_s: float = 0.0) -> None:
        """`max_tokens` None sends none (the engine's own length); `timeout_s` bounds
        each request. `workers` None is the open loop (Poisson arrivals at each
        target's rate); a number is the closed loop, that many workers per target,
        each pausing `pause_s` after every answer."""
        if workers is None:
            if not targets or any(t.rps <= 0 for t in targets):
                raise ValueError("load: need at least one target, each with a positive rate")
        elif not targets or workers < 1 or pause_s < 0:
            raise ValueError(f"load: a closed loop needs at least one target, at least one "
                             f"worker and a pause of 0 s or more, got {len(targets)} "
                             f"target(s), {workers} worker(s), pause {pause_s} s")
        self.targets = list(targets)
        self.stream_share = stream_share
        self.max_tokens = max_tokens
        self.prompt = prompt
        self.timeout_s = timeout_s
        self.workers = workers
        self.pause_s = pause_s
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

    @classmethod
    def closed_loop(cls, url: str, models: Sequence[str], workers: int, *,
                    pause_s: float = 0.0, **kw: object) -> LoadGenerator:
        """Clients of one base URL, `workers` closed-loop workers per model."""
        targets = [Target(url, m) for m in models]
        return cls(targets, workers=workers, pause_s=pause_s, **kw)  # type: ignore[arg-type]

    def set_rate(self, model: str, rps: float, *, base_url: str | None = None) -> None:
        """Change the rate of every target of `model` (at `base_url` only, when given);
        it takes effect at the next arrival."""
        if self.workers is not None:
            raise ValueError("load: a closed loop has no rate to set")
        if rps <= 0:
            raise ValueError(f"load: a rate must be positive, got {rps}")
        for i, t in enumerate(self.targets):
            if t.model == model and base_url in (None, t.base_url):
                self._rates[i] = rps

    # -- async use ----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Send until `stop` is set, then wait for the requests in flight."""
        connector = aiohttp.TCPConnector(limit=CONNECTIONS)
        async with aiohttp.ClientSession(connector=connector) as session:
            if self.workers is None:
                await asyncio.gather(*(self._target_loop(session, i, stop)
                                       for i in range(len(self.targets))))
            else:
                await asyncio.gather(*(self._worker(session, t, stop) for t in self.targets
                                       for _ in range(self.workers)))

    async def run_for(self, seconds: float) -> None:
        """Send for `seconds`, then wait for the requests in flight."""
        stop = asyncio.Event()
        timer = asyncio.get_running_loop().call_later(seconds, stop.set)
        try:
            await self.run(stop)
        finally:
            timer.cancel()

    async def _target_loop(self, session: aiohttp.ClientSession, i: int, stop: asyncio.Event) -> None:
        inflight: set[asyncio.Task[None]] = set()
        target = self.targets[i]
        loop = asyncio.get_running_loop()
        due = loop.time()
        while not stop.is_set():
            # The next arrival is due an exponential gap after the last one was due, not
            # after it was sent: timer lag on a busy host does not lower the rate.
            due += self._rng.expovariate(self._rates[i])
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, due - loop.time()))
                break
            except TimeoutError:
                pass
            stream = self._rng.random() < self.stream_share
            task = asyncio.create_task(self._one(session, target, stream))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
        await asyncio.gather(*inflight, return_exceptions=True)

    async def _worker(self, session: aiohttp.ClientSession, target: Target,
                      stop: asyncio.Event) -> None:
        """One closed-loop client: the next request when the last one has finished."""
        while not stop.is_set():
            stream = self._rng.random() < self.stream_share
            await self._one(session, target, stream)
            if self.pause_s <= 0:
                await asyncio.sleep(0)  # let the others run when answers come at once
                continue
            try:
                await asyncio.wait_for(stop.wait(), self.pause_s)
                break
            except TimeoutError:
                pass

    async def _one(self, session: aiohttp.ClientSession, target: Target, stream: bool) -> None:
        self.sent += 1
        body: dict[str, object] = {"model": target.model, "prompt": self.prompt,
                                   "stream": stream}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        try:
            async with session.post(f"{target.base_url}/v1/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
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
