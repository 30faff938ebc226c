"""trtllm-serve's JSON `/metrics`: per-iteration stats, drained on each read.

The real server records one object per engine iteration while it has work
(with `enable_iter_perf_stats: true`) and returns, on each `GET /metrics`, the
objects accumulated since the previous read. Key names and nesting follow the
captured 1.0.0rc4 object in `fixtures/engine-metrics/`. `reusedBlocks` and
`missedBlocks` are cumulative (the engine's `cacheHitRate` is reused / (reused +
missed), and its Prometheus collector takes their differences).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime
from typing import Any

from gearshift.agents.emulator.batching import KV_TOKENS_PER_BLOCK, BatchEngine

MAX_KEPT_ITERATIONS = 1000
GPU_MEMORY_BYTES = 80 * 1024**3
CPU_MEM_USAGE_BYTES = 68172
PINNED_MEM_USAGE_BYTES = 2952841216
MAX_NUM_TOKENS = 8192


class IterationStats:
    """Ring of iteration-stat objects (oldest dropped past MAX_KEPT_ITERATIONS)."""

    def __init__(self, engine: BatchEngine, *, gpu_memory_fraction: float,
                 wall_clock: Callable[[], float] = time.time,
                 max_kept: int = MAX_KEPT_ITERATIONS) -> None:
        self._engine = engine
        self._gpu_mem_bytes = int(GPU_MEMORY_BYTES * gpu_memory_fraction)
        self._wall_clock = wall_clock
        self._stats: deque[dict[str, Any]] = deque(maxlen=max_kept)
        self._iter = 0
        self._completed = 0
        self._new_active = 0
        self._new_queue_ms = 0.0
        self._alloc_total_blocks = 0

    def note_admitted(self, queue_s: float) -> None:
        self._new_active += 1
        self._new_queue_ms += queue_s * 1000.0

    def note_completed(self) -> None:
        self._completed += 1

    @property
    def pending(self) -> bool:
        """Work happened since the last recorded iteration."""
        return self._completed > 0 or self._new_active > 0

    def record(self, iter_latency_s: float) -> None:
        """Append one iteration's stats and reset the per-iteration counters."""
        eng = self._engine
        cache = eng.prefix_cache
        used = eng.kv_used_blocks
        new_blocks = used if self._new_active else 0
        self._alloc_total_blocks += new_blocks
        queue_ms = self._new_queue_ms / self._new_active if self._new_active else 0.0
        stamp = datetime.fromtimestamp(self._wall_clock()).strftime("%m-%d-%Y %H:%M:%S.%f")
        self._stats.append({
            "cpuMemUsage": CPU_MEM_USAGE_BYTES,
            "gpuMemUsage": self._gpu_mem_bytes,
            "inflightBatchingStats": {
                "avgNumDecodedTokensPerIter": 1.0,
                "microBatchId": 0,
                "numContextRequests": self._new_active,
                "numCtxTokens": 0,
                "numGenRequests": max(0, eng.running - self._new_active),
                "numPausedRequests": 0,
                "numScheduledRequests": eng.running,
            },
            "iter": self._iter,
            "iterLatencyMS": iter_latency_s * 1000.0,
            "kvCacheStats": {
                "allocNewBlocks": new_blocks,
                "allocTotalBlocks": self._alloc_total_blocks,
                "cacheHitRate": (cache.reused_blocks / (cache.reused_blocks + cache.missed_blocks)
                                 if cache.reused_blocks + cache.missed_blocks else 0.0),
                "freeNumBlocks": eng.kv_max_blocks - used,
                "maxNumBlocks": eng.kv_max_blocks,
                "missedBlocks": cache.missed_blocks,
                "reusedBlocks": cache.reused_blocks,
                "tokensPerBlock": KV_TOKENS_PER_BLOCK,
                "usedNumBlocks": used,
            },
            "maxBatchSizeRuntime": eng.max_batch,
            "maxBatchSizeStatic": eng.max_batch,
            "maxBatchSizeTunerRecommended": eng.max_batch,
            "maxNumActiveRequests": eng.max_batch,
            "maxNumTokensRuntime": MAX_NUM_TOKENS,
            "maxNumTokensStatic": MAX_NUM_TOKENS,
            "maxNumTokensTunerRecommended": 0,
            "newActiveRequestsQueueLatencyMS": queue_ms,
            "numActiveRequests": eng.running,
            "numCompletedRequests": self._completed,
            "numNewActiveRequests": self._new_active,
            "numQueuedRequests": eng.waiting,
            "pinnedMemUsage": PINNED_MEM_USAGE_BYTES,
            "specDecodingStats": None,
            "staticBatchingStats": None,
            "timestamp": stamp,
        })
        self._iter += 1
        self._completed = 0
        self._new_active = 0
        self._new_queue_ms = 0.0

    def drain(self) -> list[dict[str, Any]]:
        """Everything recorded since the previous drain, oldest first."""
        out = list(self._stats)
        self._stats.clear()
        return out

    async def run(self) -> None:
        """Record an iteration every decode step while the engine has work."""
        while True:
            if not self._engine.busy and not self.pending:
                await self._engine.wait_busy()
            step_s = self._engine.itl_s()
            await asyncio.sleep(step_s)
            self.record(step_s)
