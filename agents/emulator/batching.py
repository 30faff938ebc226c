"""Continuous-batching queueing model of an inference engine.

Requests hold one of `max_batch` batch slots from admission to their last
token; the others wait in FIFO order (vLLM's "waiting" requests). The prefill
(time from admission to the first token) and the inter-token latency both grow
mildly with the batch occupancy, as a real engine's step time does, so TTFT =
base + queueing delay, and the queueing delay rises steeply as the offered load
approaches the capacity. `max_batch` is derived so that a full batch of
default-length requests completes `capacity_rps` requests per second.

Everything is asyncio sleeps: no busy loops, cheap enough for tests.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from gearshift.agents.emulator.prefix_cache import PrefixCache

# At a full batch, prefill and each decode step take this much longer (fraction).
BATCH_SLOWDOWN_AT_FULL = 0.5
# Prompt tokens add prefill time on top of the base TTFT.
PREFILL_S_PER_PROMPT_TOKEN = 0.00002
# KV-cache budget per batch slot, in tokens (usage = tokens held / budget).
KV_TOKENS_PER_SLOT = 512
KV_TOKENS_PER_BLOCK = 32


def derive_max_batch(capacity_rps: float, ttft_base_s: float, itl_s: float,
                     output_tokens: int) -> int:
    """Smallest batch whose full-load throughput reaches `capacity_rps`."""
    slow = 1.0 + BATCH_SLOWDOWN_AT_FULL
    service_s = ttft_base_s * slow + max(0, output_tokens - 1) * itl_s * slow
    return max(1, math.ceil(capacity_rps * service_s - 1e-9))


class BatchEngine:
    """Admission control and latencies of the emulated engine (one per process)."""

    def __init__(self, *, max_batch: int, ttft_base_s: float, itl_s: float,
                 latency_factor: float = 1.0) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.ttft_base_s = ttft_base_s
        self.itl_base_s = itl_s
        self.latency_factor = latency_factor
        self.running = 0
        self.waiting = 0
        self.kv_tokens = 0
        self.prefix_cache = PrefixCache(block_tokens=KV_TOKENS_PER_BLOCK)
        # vLLM sleep mode: 0 awake, 1 weights offloaded, 2 weights and KV discarded.
        self.sleep_level = 0
        self._slots = asyncio.Semaphore(max_batch)
        self._activity = asyncio.Event()

    # --- state read by the metrics -------------------------------------------------
    @property
    def kv_usage(self) -> float:
        """KV-cache usage in 0..1."""
        return min(1.0, self.kv_tokens / (self.max_batch * KV_TOKENS_PER_SLOT))

    @property
    def kv_max_blocks(self) -> int:
        return self.max_batch * KV_TOKENS_PER_SLOT // KV_TOKENS_PER_BLOCK

    @property
    def kv_used_blocks(self) -> int:
        return min(self.kv_max_blocks, math.ceil(self.kv_tokens / KV_TOKENS_PER_BLOCK))

    @property
    def busy(self) -> bool:
        return self.running > 0 or self.waiting > 0

    async def wait_busy(self) -> None:
        """Return once a request is running or waiting."""
        while not self.busy:
            self._activity.clear()
            await self._activity.wait()

    # --- latencies -----------------------------------------------------------------
    def _slowdown(self) -> float:
        occupancy = self.running / self.max_batch
        return (1.0 + BATCH_SLOWDOWN_AT_FULL * occupancy) * self.latency_factor

    def prefill_s(self, prompt_tokens: int) -> float:
        """Time from admission to the first token at the current occupancy."""
        return (self.ttft_base_s + PREFILL_S_PER_PROMPT_TOKEN * prompt_tokens) * self._slowdown()

    def itl_s(self) -> float:
        """Time between two output tokens at the current occupancy."""
        return self.itl_base_s * self._slowdown()

    # --- admission -----------------------------------------------------------------
    @asynccontextmanager
    async def slot(self, prompt_tokens: int) -> AsyncIterator[KvHold]:
        """Hold a batch slot (waiting FIFO for one first); release it on exit or cancel."""
        self.waiting += 1
        self._activity.set()
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        hold = KvHold(self)
        hold.add(prompt_tokens)
        try:
            yield hold
        finally:
            self.running -= 1
            self.kv_tokens -= hold.tokens
            self._slots.release()


class KvHold:
    """The KV-cache tokens one running request holds; freed with its slot."""

    def __init__(self, engine: BatchEngine) -> None:
        self._engine = engine
        self.tokens = 0

    def add(self, count: int) -> None:
        self.tokens += count
        self._engine.kv_tokens += count
