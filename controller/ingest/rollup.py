"""Per-minute rollups of agent reports: pure, no I/O, on the ingest hot path.

`RollupAggregator.add` folds one `DeploymentReport` into the bucket of its
(model, engine, minute); `flush_completed(now)` hands back the `RollupRow`s of
the minutes that can no longer receive reports (a minute is complete once
``now >= minute_start + 60 + LATENESS_S``). Reports for a minute already handed
back are dropped and counted in `late_reports` (writing them would replace the
complete row with a partial one).

How a minute is summarised (no library computes these from pre-aggregated
reports, hence the hand-written fold):

- Only reports with ``metrics_present`` count; a minute without any yields no row.
  `reports` counts them, `replicas` counts their distinct deployments.
- Totals per model and engine: `request_rate_mean`, `running_mean`,
  `waiting_mean` and `generation_tokens_per_s` are the sum over deployments of
  each deployment's mean within the minute. `request_rate_max` is the peak of
  the total rebuilt after each report as the sum of every deployment's latest
  rate in that minute.
- `kv_cache_usage_mean` is the plain mean over the reports (a fraction, not a total).
- Latency: p50 is the count-weighted mean of the report p50s. p99 is the
  count-weighted 99th percentile of the report p99s: the slowest report's p99
  unless the slowest reports together hold under 1 % of the minute's requests,
  in which case those are skipped. The true p99 of the merged requests lies
  between the smallest and the largest report p99; this choice stays near the
  conservative end without letting one slow request in a nearly idle report
  decide the minute. A quantile marked present with ``count == 0`` weighs as
  one request. No present quantile in the minute → NULL.
- `errors` sums per-deployment deltas of ``errors_total``; a drop of the counter
  means the engine restarted, and the new value is the delta. A deployment's
  first report gives no delta (nothing to subtract). Baselines survive minute
  boundaries and are forgotten after `BASELINE_TTL_S` without reports (checked
  every `BASELINE_SWEEP_S`).
- `engine_version` and `gpu_model` are the last non-empty values seen.
- SLA signals (docs/engines.md): `queue_p50_s` / `queue_p99_s` as the other latencies;
  `preemptions_per_s` the sum over deployments of each one's mean (over its reports
  that have the field); `prefix_cache_hit_rate`, `mean_prompt_tokens` and
  `mean_generation_tokens` the plain mean over the reports that have them;
  `sleeping_replicas` the deployments whose latest report in the minute says asleep;
  `kv_blocks_total` / `kv_blocks_used` the sum over deployments of each one's latest.
  A signal no report of the minute had is NULL, never 0.

How a minute is held until it is handed back (numbers, not an object per deployment or
per sample, with every figure read back exactly as added): `controller.ingest.rollup_minute`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from sys import intern
from typing import TypeVar

from gearshift.common.errors import InvalidArgument
from gearshift.controller.ingest.rollup_minute import P99_TAIL_FRACTION as P99_TAIL_FRACTION
from gearshift.controller.ingest.rollup_minute import Bucket
from gearshift.controller.store.tables import RollupRow
from gearshift.v1 import agent_pb2

MINUTE_S = 60
LATENESS_S = 5.0  # reports may arrive this long after their minute ended
BASELINE_TTL_S = 600.0  # forget a deployment's errors_total baseline after this long unseen
BASELINE_SWEEP_S = 60.0  # look for such baselines at most this often
ROWS_SLICE_S = 0.004  # `to_rows_in_slices`: the event loop's longest wait for it
_N = TypeVar("_N", int, float)


_ASLEEP = frozenset({agent_pb2.ENGINE_SLEEP_STATE_WEIGHTS_OFFLOADED,
                     agent_pb2.ENGINE_SLEEP_STATE_DISCARD_ALL})


class RollupAggregator:
    """Folds deployment reports into per-minute `RollupRow`s. Not thread-safe: call it
    from one thread (the controller's event loop)."""

    def __init__(self, lateness_s: float = LATENESS_S) -> None:
        self._lateness_s = lateness_s
        self._buckets: dict[tuple[str, str, int], Bucket] = {}
        # Deployment id -> errors_total and when it was reported, in two dicts of numbers
        # (not one of tuples): updating them allocates nothing the garbage collector
        # walks, where a tuple per deployment per report was 80,000 every interval at
        # 10,000 hosts (see gc_policy).
        self._errors_total: dict[str, int] = {}
        self._errors_seen: dict[str, float] = {}
        self._watermark = -math.inf  # minutes starting before this were handed back
        self._baselines_swept = -math.inf
        self.late_reports = 0

    def add(self, host_id: str, report: agent_pb2.DeploymentReport, ts: float,
            gpu_model: str = "") -> None:
        """Fold one report taken at `ts` (seconds since the epoch) into its minute.

        Deployments are keyed by their (fleet-unique) deployment_id; `host_id`
        only names the source in errors. A NaN or infinite time or metric raises
        InvalidArgument and changes nothing.
        """
        if not report.metrics_present:
            return
        # Each figure is read once (a protobuf field read costs as much as the arithmetic):
        # the finiteness check and the fold share the values read here.
        t, i, e, q = report.ttft, report.itl, report.e2e, report.queue_time
        rate = report.request_rate
        running = report.running_requests
        waiting = report.waiting_requests
        gen = report.generation_tokens_per_s
        kv = report.kv_cache_usage
        t50, t99, i50, i99 = t.p50_s, t.p99_s, i.p50_s, i.p99_s
        e50, e99, q50, q99 = e.p50_s, e.p99_s, q.p50_s, q.p99_s
        preempt = report.preemptions_per_s
        hit_rate = report.prefix_cache_hit_rate
        prompt_len = report.mean_prompt_tokens
        gen_len = report.mean_generation_tokens
        if not math.isfinite(
                ts + rate + running + waiting + gen + kv + t50 + t99
                + i50 + i99 + e50 + e99 + q50 + q99
                + preempt + hit_rate + prompt_len + gen_len):
            raise InvalidArgument(
                f"report of deployment {report.deployment_id!r} from host {host_id!r}: "
                f"time or a metric is not a finite number (NaN or infinity)")
        minute = int(ts // MINUTE_S) * MINUTE_S
        if minute < self._watermark:
            self.late_reports += 1  # its errors delta moves to the next accepted report
            return
        key = (report.model, report.engine, minute)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = Bucket()
        dep_id = report.deployment_id
        deps = bucket.deps
        k = deps.slot.get(dep_id)
        if k is None:
            dep_id = intern(dep_id)  # kept: one string with the fleet's (see fleet._kept_shape)
            k = deps.add(dep_id)
        deps.n[k] += 1
        deps.rate_sum[k] += rate
        rate_latest = deps.rate_latest
        bucket.rate_total += rate - rate_latest[k]
        rate_latest[k] = rate
        if bucket.rate_total > bucket.rate_max:
            bucket.rate_max = bucket.rate_total
        deps.running_sum[k] += running
        deps.waiting_sum[k] += waiting
        deps.gen_sum[k] += gen
        bucket.reports += 1
        bucket.kv_sum += kv
        bucket.ttft.add(t, t50, t99)
        bucket.itl.add(i, i50, i99)
        bucket.e2e.add(e, e50, e99)
        bucket.queue.add(q, q50, q99)
        # An optional signal that is not set reads 0: a figure that is not 0 was set, and
        # only a 0 needs the (dearer) question.
        has = report.HasField
        if preempt or has("preemptions_per_s"):
            deps.preempt_n[k] += 1
            deps.preempt_sum[k] += preempt
        if hit_rate or has("prefix_cache_hit_rate"):
            bucket.hit_rate.add(hit_rate)
        if prompt_len or has("mean_prompt_tokens"):
            bucket.prompt_len.add(prompt_len)
        if gen_len or has("mean_generation_tokens"):
            bucket.gen_len.add(gen_len)
        deps.sleeping[k] = report.sleep_state in _ASLEEP
        if has("kv_blocks_total"):
            deps.blocks_total[k] = report.kv_blocks_total
            deps.blocks_set[k] |= 1
        if has("kv_blocks_used"):
            deps.blocks_used[k] = report.kv_blocks_used
            deps.blocks_set[k] |= 2
        version = report.engine_version
        if version:
            bucket.engine_version = version
        if gpu_model:
            bucket.gpu_model = gpu_model
        errors_total = report.errors_total
        totals = self._errors_total
        prev = totals.get(dep_id)
        if prev is not None:
            bucket.errors += errors_total - prev if errors_total >= prev else errors_total
        totals[dep_id] = errors_total  # a new key: interned when its first slot was made
        self._errors_seen[dep_id] = ts

    def flush_completed(self, now: float) -> list[RollupRow]:
        """Rows of every minute complete at `now`; later reports for them are dropped."""
        return to_rows(self.pop_completed(now))

    def pop_completed(self, now: float) -> list[tuple[tuple[str, str, int], Bucket]]:
        """Detach the minutes complete at `now` (cheap); `to_rows` turns them into rows and
        may run on another thread, since the detached buckets are no longer shared."""
        watermark = int((now - self._lateness_s) // MINUTE_S) * MINUTE_S
        self._watermark = max(self._watermark, watermark)
        done = sorted((k for k in self._buckets if k[2] + MINUTE_S <= watermark),
                      key=lambda k: k[2])
        popped = [(k, self._buckets.pop(k)) for k in done]
        if now - self._baselines_swept >= BASELINE_SWEEP_S:  # a fleet-sized walk: not every call
            self._baselines_swept = now
            stale = [d for d, seen in self._errors_seen.items() if seen < now - BASELINE_TTL_S]
            for dep_id in stale:
                del self._errors_seen[dep_id], self._errors_total[dep_id]
        return popped

    def flush_all(self) -> list[RollupRow]:
        """Rows of every minute, complete or not (shutdown); later reports for them are dropped."""
        keys = sorted(self._buckets, key=lambda k: k[2])
        if keys:
            self._watermark = max(self._watermark, keys[-1][2] + MINUTE_S)
        return [_row(k, self._buckets.pop(k)) for k in keys]

    @property
    def open_minutes(self) -> int:
        """How many (model, engine, minute) buckets are still open."""
        return len(self._buckets)


def to_rows(popped: list[tuple[tuple[str, str, int], Bucket]]) -> list[RollupRow]:
    return [_row(k, b) for k, b in popped]


async def to_rows_in_slices(popped: list[tuple[tuple[str, str, int], Bucket]], *,
                            slice_s: float = ROWS_SLICE_S) -> list[RollupRow]:
    """`to_rows` on the event loop, handing it back every `slice_s` of work.

    A minute of a fleet of 10,000 hosts (80,000 deployments) takes about 0.2 s to
    summarise. On a thread that is no better than on the loop: the thread holds the
    GIL for the interpreter's switch interval (5 ms) every time the loop lets it go, at
    each of the loop's wake-ups, so the loop ran at a fraction of its speed for a
    second or more and acks queued behind it. In slices the loop stays whole: a report
    waits for one slice at most.
    """
    rows: list[RollupRow] = []
    started = time.perf_counter()
    for key, bucket in popped:
        rows.append(_row(key, bucket))
        if time.perf_counter() - started >= slice_s:
            await asyncio.sleep(0)
            started = time.perf_counter()
    return rows


def _row(key: tuple[str, str, int], b: Bucket) -> RollupRow:
    model, engine, minute = key
    d = b.deps
    n = d.n
    # Sums over the deployments in slot order (their order of first report), one at a
    # time from 0, as Python's sum adds.
    return RollupRow(
        model=model,
        engine=engine,
        minute=datetime.fromtimestamp(minute, UTC),
        engine_version=b.engine_version,
        gpu_model=b.gpu_model,
        reports=b.reports,
        replicas=len(n),
        request_rate_mean=sum(s / c for s, c in zip(d.rate_sum, n, strict=True)),
        request_rate_max=b.rate_max,
        running_mean=sum(s / c for s, c in zip(d.running_sum, n, strict=True)),
        waiting_mean=sum(s / c for s, c in zip(d.waiting_sum, n, strict=True)),
        ttft_p50_s=b.ttft.p50(),
        ttft_p99_s=b.ttft.p99(),
        itl_p50_s=b.itl.p50(),
        itl_p99_s=b.itl.p99(),
        e2e_p99_s=b.e2e.p99(),
        generation_tokens_per_s=sum(s / c for s, c in zip(d.gen_sum, n, strict=True)),
        kv_cache_usage_mean=b.kv_sum / b.reports,
        errors=b.errors,
        queue_p50_s=b.queue.p50(),
        queue_p99_s=b.queue.p99(),
        preemptions_per_s=_sum_or_none(s / c for s, c in zip(d.preempt_sum, d.preempt_n,
                                                               strict=True) if c),
        prefix_cache_hit_rate=b.hit_rate.value(),
        mean_prompt_tokens=b.prompt_len.value(),
        mean_generation_tokens=b.gen_len.value(),
        sleeping_replicas=sum(d.sleeping),
        kv_blocks_total=_sum_or_none(v for v, f in zip(d.blocks_total, d.blocks_set,
                                                       strict=True) if f & 1),
        kv_blocks_used=_sum_or_none(v for v, f in zip(d.blocks_used, d.blocks_set,
                                                      strict=True) if f & 2),
    )


def _sum_or_none(values: Iterable[_N]) -> _N | None:
    total: _N | None = None
    for value in values:
        total = value if total is None else total + value
    return total
