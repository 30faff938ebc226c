"""Parse trtllm-serve's JSON `GET /metrics` (iteration statistics) into an `EngineSnapshot`.

The endpoint returns a JSON array with one object per engine iteration since the
previous read, and each read drains it (it needs `enable_iter_perf_stats: true`).
An empty array `[]` is valid: no iteration ran since the last read. Mapping:
- running = `numActiveRequests`, waiting = `numQueuedRequests`, KV-cache usage =
  `kvCacheStats.usedNumBlocks / kvCacheStats.maxNumBlocks`, all from the newest
  iteration that has them;
- `completed_in_window` = the sum of `numCompletedRequests` over the array (the
  requests finished since the previous read, so it is already a delta);
- `iter_latency_s` = the mean `iterLatencyMS`, in seconds;
- KV blocks total/used = `kvCacheStats.maxNumBlocks` / `usedNumBlocks`, and the
  prefix-cache counters hits = `kvCacheStats.reusedBlocks`, queries = `reusedBlocks +
  missedBlocks` (cumulative since the engine started, as the engine's own
  `cacheHitRate` = reused / (reused + missed) shows), from the newest iteration.
A single top-level object (as quoted in TensorRT-LLM issue 6364) is read as a
one-element array. Fields of the wrong type or out of range are skipped with a
reason; a body that is not JSON raises `MetricsParseError` naming the place.
"""

from __future__ import annotations

import json
import math
from typing import Any

from gearshift.agents.metrics.model import EngineSnapshot, MetricsParseError, Skip, SkipReason

MS_PER_S = 1000.0
ELLIPSIS_HINT = (
    "; the body contains a literal '...' (an abbreviated example, e.g. the one in the "
    "trtllm-serve docs), which is not JSON"
)


def parse_trtllm_json(text: str, *, source: str = "trtllm-serve /metrics") -> EngineSnapshot:
    """Read one trtllm-serve iteration-stats body; raise `MetricsParseError` if unusable."""
    if not isinstance(text, str):
        raise MetricsParseError(f"{source}: expected text, got {type(text).__name__}")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = ELLIPSIS_HINT if "..." in text else ""
        raise MetricsParseError(
            f"{source}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}{hint}"
        ) from exc
    except (ValueError, RecursionError) as exc:
        raise MetricsParseError(f"{source}: not valid JSON: {exc}") from exc
    if isinstance(document, dict):
        document = [document]
    if not isinstance(document, list):
        raise MetricsParseError(
            f"{source}: expected a JSON array of iteration stats, got {_json_type(document)}",
            SkipReason.WRONG_TYPE,
        )
    return _Iterations(source).read(document)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


class _Iterations:
    def __init__(self, source: str) -> None:
        self._source = source
        self.skips: list[Skip] = []

    def _skip(self, reason: SkipReason, where: str, detail: str) -> None:
        self.skips.append(Skip(reason, f"{self._source}: {where}: {detail}"))

    def _number(self, obj: dict[str, Any], key: str, where: str) -> float | None:
        """A finite, non-negative number at `obj[key]`; None (with a skip) otherwise."""
        if key not in obj or obj[key] is None:
            return None
        value = obj[key]
        path = f"{where}.{key}"
        if isinstance(value, bool) or not isinstance(value, int | float):
            self._skip(SkipReason.WRONG_TYPE, path, f"expected a number, got {_json_type(value)}")
            return None
        try:
            number = float(value)
        except OverflowError:  # a JSON integer beyond the float range
            number = math.inf
        if math.isnan(number) or math.isinf(number):
            self._skip(SkipReason.NON_FINITE, path, f"{number}")
            return None
        if number < 0:
            self._skip(SkipReason.NEGATIVE, path, f"{number}")
            return None
        return number

    def read(self, document: list[Any]) -> EngineSnapshot:
        running: float | None = None
        waiting: float | None = None
        kv: float | None = None
        blocks: tuple[float, float] | None = None
        reuse: tuple[float, float] | None = None
        completed: float | None = None
        latencies_s: list[float] = []
        for index, item in enumerate(document):
            where = f"[{index}]"
            if not isinstance(item, dict):
                self._skip(
                    SkipReason.WRONG_TYPE, where, f"expected an object, got {_json_type(item)}"
                )
                continue
            # Later iterations overwrite earlier ones: gauges are the newest values.
            running = _newer(running, self._number(item, "numActiveRequests", where))
            waiting = _newer(waiting, self._number(item, "numQueuedRequests", where))
            kv = _newer(kv, self._kv_usage(item, where))
            blocks = self._kv_blocks(item, where) or blocks
            reuse = self._block_reuse(item, where) or reuse
            done = self._number(item, "numCompletedRequests", where)
            if done is not None and not math.isinf((completed or 0.0) + done):
                completed = (completed or 0.0) + done
            latency_ms = self._number(item, "iterLatencyMS", where)
            if latency_ms is not None:
                latencies_s.append(latency_ms / MS_PER_S)
        return EngineSnapshot(
            running=running,
            waiting=waiting,
            kv_cache_usage=kv,
            completed_in_window=completed,
            kv_blocks_total=blocks[0] if blocks else None,
            kv_blocks_used=blocks[1] if blocks else None,
            prefix_cache_hits=reuse[0] if reuse else None,
            prefix_cache_queries=reuse[1] if reuse else None,
            iter_latency_s=sum(x / len(latencies_s) for x in latencies_s) if latencies_s else None,
            skips=tuple(self.skips),
        )

    def _kv_usage(self, item: dict[str, Any], where: str) -> float | None:
        stats = item.get("kvCacheStats")
        if stats is None:
            return None
        where = f"{where}.kvCacheStats"
        if not isinstance(stats, dict):
            self._skip(SkipReason.WRONG_TYPE, where, f"expected an object, got {_json_type(stats)}")
            return None
        used = self._number(stats, "usedNumBlocks", where)
        most = self._number(stats, "maxNumBlocks", where)
        if used is None or most is None:
            return None
        if most == 0 or used > most:
            self._skip(
                SkipReason.OUT_OF_RANGE, where, f"usedNumBlocks={used:g} maxNumBlocks={most:g}"
            )
            return None
        return used / most


    def _kv_stats(self, item: dict[str, Any], where: str) -> dict[str, Any] | None:
        stats = item.get("kvCacheStats")
        return stats if isinstance(stats, dict) else None  # a wrong type is skipped by _kv_usage

    def _kv_blocks(self, item: dict[str, Any], where: str) -> tuple[float, float] | None:
        """(maxNumBlocks, usedNumBlocks) when both are there and consistent (checked
        and skipped with a reason by `_kv_usage`)."""
        stats = self._kv_stats(item, where)
        if stats is None:
            return None
        most: Any = stats.get("maxNumBlocks")
        used: Any = stats.get("usedNumBlocks")
        if not (_plain_number(most) and _plain_number(used)):
            return None
        total, taken = float(most), float(used)
        return (total, taken) if 0 <= taken <= total and total > 0 else None

    def _block_reuse(self, item: dict[str, Any], where: str) -> tuple[float, float] | None:
        """(reusedBlocks, reusedBlocks + missedBlocks): the prefix-cache counters."""
        stats = self._kv_stats(item, where)
        if stats is None:
            return None
        path = f"{where}.kvCacheStats"
        reused = self._number(stats, "reusedBlocks", path)
        missed = self._number(stats, "missedBlocks", path)
        if reused is None or missed is None or math.isinf(reused + missed):
            return None
        return reused, reused + missed


def _plain_number(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, int | float)
            and math.isfinite(value))


def _newer(old: float | None, new: float | None) -> float | None:
    return new if new is not None else old
