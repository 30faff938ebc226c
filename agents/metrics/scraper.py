"""Scrape an engine's metric endpoints over HTTP and turn them into `EngineSample`s.

Which paths to read, in which format, and which metric names fill which field
come from the engine's catalog entry (`gearshift.common.engines`): for example
vLLM has `GET /metrics` (Prometheus text); trtllm-serve has `GET
/prometheus/metrics` (Prometheus text, optional: a 404 or a body with no known
metric means "not enabled") and `GET /metrics` (JSON iteration stats, drained on
each read), which gives running/waiting requests and KV-cache usage, and the
request rate when there is no Prometheus counter. All endpoints of an entry are
read at once; the sample fails only when none of them gave a body.

`scrape()` never raises: an unreachable engine, a bad status or a bad body gives
a sample with `metrics_present=False` and a reason; dropped series and scrapes
are logged and counted in `gearshift_agent_metric_samples_skipped_total`.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar, Protocol

import aiohttp
from prometheus_client import REGISTRY, CollectorRegistry, Counter

from gearshift.agents.metrics.model import (
    EngineSample,
    EngineSnapshot,
    MetricsParseError,
    Skip,
    SkipReason,
)
from gearshift.agents.metrics.prometheus_index import LineCache
from gearshift.agents.metrics.prometheus_text import parse_prometheus_text
from gearshift.agents.metrics.rates import RateCalculator
from gearshift.agents.metrics.trtllm_json import parse_trtllm_json
from gearshift.common.engines import (
    EngineEntry,
    MetricEndpoint,
    MetricFormat,
    MetricNames,
    engine_entry,
)
from gearshift.common.errors import InvalidArgument

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0
MAX_BODY_BYTES = 8 * 1024 * 1024
HTTP_OK = 200
HTTP_NOT_FOUND = 404


class ScraperMetrics:
    """The scrapers' own Prometheus metrics; one container per registry."""

    _by_registry: ClassVar[weakref.WeakKeyDictionary[CollectorRegistry, ScraperMetrics]] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, registry: CollectorRegistry) -> None:
        self.samples_skipped = Counter(
            "gearshift_agent_metric_samples_skipped_total",
            "Engine metric scrapes or series that were not used, by reason.",
            ["engine", "reason"],
            registry=registry,
        )
        self.scrapes_refused = Counter(
            "gearshift_agent_metric_scrapes_refused_total",
            "Engine scrapes not used because a series held a broken value (NaN, out of range).",
            ["engine"],
            registry=registry,
        )
        self.counter_resets = Counter(
            "gearshift_agent_metric_counter_resets_total",
            "Engine counters found lower than at the previous scrape (engine restarts).",
            ["engine"],
            registry=registry,
        )

    @classmethod
    def for_registry(cls, registry: CollectorRegistry | None = None) -> ScraperMetrics:
        """The container registered in `registry` (the global one by default)."""
        target = REGISTRY if registry is None else registry
        existing = cls._by_registry.get(target)
        if existing is None:
            existing = cls._by_registry[target] = cls(target)
        return existing


class MetricSource(Protocol):
    """What the agent needs from an engine's metrics."""

    async def scrape(self, now: float) -> EngineSample: ...

    async def close(self) -> None: ...


def read_engine_metrics(
    engine: str, bodies: dict[str, str | None], names: MetricNames | None = None,
    caches: Mapping[str, LineCache] | None = None,
) -> tuple[EngineSnapshot | None, tuple[Skip, ...]]:
    """Parse the bodies one scrape fetched (path -> body, None = not fetched); never raises.

    `names`: the metric names of the engine's release (its version-table row); None =
    the catalog entry's, which list every release's spellings. `caches`: by path, the
    lines of the previous scrape of each Prometheus endpoint (they change nothing read).

    Returns the snapshot (None when nothing usable was found) and every skip:
    dropped series and whole bodies that could not be read.
    """
    entry = engine_entry(engine)
    names = names or entry.metric_names
    skips: list[Skip] = []
    prometheus: EngineSnapshot | None = None
    iterations: EngineSnapshot | None = None
    for endpoint in entry.metric_endpoints:
        body = bodies.get(endpoint.path)
        if body is None:
            continue
        try:
            if endpoint.format is MetricFormat.TRTLLM_ITERATIONS:
                iterations = parse_trtllm_json(body)
                skips.extend(iterations.skips)
                continue
            found = parse_prometheus_text(body, source=endpoint.path, names=names,
                                          cache=caches.get(endpoint.path) if caches else None)
        except MetricsParseError as exc:
            skips.append(Skip(exc.reason, exc.message))
            continue
        skips.extend(found.skips)
        if found.has_data():
            prometheus = found
        elif not endpoint.optional:
            prefixes = "/".join(p for p in names.prefixes if p) or "known"
            skips.append(Skip(SkipReason.MISSING_FAMILY,
                              f"{endpoint.path}: no {prefixes} metric found"))
    return _merge(prometheus, iterations), tuple(skips)


def _merge(
    prometheus: EngineSnapshot | None, iterations: EngineSnapshot | None
) -> EngineSnapshot | None:
    """Prometheus counters and histograms; iteration stats win for the gauges."""
    if iterations is None:
        return prometheus
    if prometheus is None:
        return replace(iterations, skips=())
    return replace(
        prometheus,
        running=_prefer(iterations.running, prometheus.running),
        waiting=_prefer(iterations.waiting, prometheus.waiting),
        kv_cache_usage=_prefer(iterations.kv_cache_usage, prometheus.kv_cache_usage),
        kv_blocks_total=_prefer(iterations.kv_blocks_total, prometheus.kv_blocks_total),
        kv_blocks_used=_prefer(iterations.kv_blocks_used, prometheus.kv_blocks_used),
        **_prefix_counters(prometheus, iterations),
        completed_in_window=iterations.completed_in_window,
        iter_latency_s=iterations.iter_latency_s,
        skips=(),
    )


def _prefix_counters(prometheus: EngineSnapshot, iterations: EngineSnapshot
                     ) -> dict[str, float | None]:
    """Both prefix-cache counters from one source: the Prometheus text's if it has them."""
    source = prometheus if prometheus.prefix_cache_queries is not None else iterations
    return {"prefix_cache_hits": source.prefix_cache_hits,
            "prefix_cache_queries": source.prefix_cache_queries}


def _prefer(first: float | None, second: float | None) -> float | None:
    return first if first is not None else second


@dataclass(frozen=True)
class _Fetched:
    """One GET: the body on 200, else the status, else why it failed."""

    body: str | None = None
    status: int | None = None
    failure: Skip | None = None


class EngineScraper:
    """Scrapes one deployment's engine and keeps its rate state."""

    def __init__(
        self,
        engine: str,
        base_url: str,
        *,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        registry: CollectorRegistry | None = None,
        names: MetricNames | None = None,
    ) -> None:
        self.entry: EngineEntry = engine_entry(engine)
        self.names = names  # the release's metric names (None: the entry's, every release's)
        if not base_url.startswith(("http://", "https://")):
            raise InvalidArgument(
                f"engine base URL must start with http:// or https://, got {base_url!r}"
            )
        if timeout_s <= 0:
            raise InvalidArgument(f"scrape timeout_s must be positive, got {timeout_s}")
        self.engine = engine
        self.base_url = base_url.rstrip("/")
        self._session = session
        self._owns_session = session is None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._metrics = ScraperMetrics.for_registry(registry)
        self._calculator = RateCalculator()
        self._line_caches = {ep.path: LineCache() for ep in self.entry.metric_endpoints
                             if ep.format is MetricFormat.PROMETHEUS}
        self._last_reasons: frozenset[SkipReason] = frozenset()

    async def __aenter__(self) -> EngineScraper:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session if this scraper created it."""
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    def reset(self) -> None:
        """Forget rate state, e.g. after the deployment was restarted on purpose."""
        self._calculator.reset()

    async def scrape(self, now: float) -> EngineSample:
        """Fetch, parse and compute the sample for the interval ending at `now`."""
        try:
            sample = await self._scrape(now)
        except Exception:  # a bug must not stop the agent's report loop
            logger.exception("scraping %s at %s failed unexpectedly", self.engine, self.base_url)
            return EngineSample(
                metrics_present=False, scraped_at=now, reason="internal error while scraping"
            )
        self._record(sample.skips)
        if sample.refused:
            self._metrics.scrapes_refused.labels(engine=self.engine).inc()
        if sample.counter_reset:
            self._metrics.counter_resets.labels(engine=self.engine).inc()
            logger.info(
                "%s at %s: a counter went down (engine restart?)", self.engine, self.base_url
            )
        return sample

    async def _scrape(self, now: float) -> EngineSample:
        endpoints = self.entry.metric_endpoints
        fetched = await asyncio.gather(*(self._get(ep.path) for ep in endpoints))
        failed = [(ep, f) for ep, got in zip(endpoints, fetched, strict=True)
                  if (f := self._failure_of(got, ep)) is not None]
        failures = [f for _, f in failed]
        bodies = {ep.path: got.body for ep, got in zip(endpoints, fetched, strict=True)}
        if all(body is None for body in bodies.values()):
            # Nothing came back: the required endpoints say why (an optional one adds nothing).
            required = [f for ep, f in failed if not ep.optional]
            return _failed(now, tuple(required or failures))
        snapshot, skips = read_engine_metrics(self.engine, bodies, self.names,
                                              self._line_caches)
        skips = (*failures, *skips)
        if snapshot is None:
            return _failed(now, skips)
        return self._calculator.update(replace(snapshot, skips=skips), now)

    def _failure_of(self, fetched: _Fetched, endpoint: MetricEndpoint) -> Skip | None:
        """Why `endpoint` gave no body; None when it did, or is optional and not enabled."""
        if fetched.failure is not None:
            return fetched.failure
        if fetched.body is None:
            if endpoint.optional and fetched.status == HTTP_NOT_FOUND:
                return None
            return Skip(SkipReason.HTTP_STATUS,
                        f"GET {self.base_url}{endpoint.path}: HTTP {fetched.status}")
        return None

    async def _get(self, path: str) -> _Fetched:
        url = self.base_url + path
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            async with self._session.get(url, timeout=self._timeout) as response:
                if response.status != HTTP_OK:
                    return _Fetched(status=response.status)
                # StreamReader.read(n) returns what has arrived so far; read to the end.
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.content.iter_chunked(64 * 1024):
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > MAX_BODY_BYTES:
                        break
                raw = b"".join(chunks)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            kind = "timed out" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
            return _Fetched(failure=Skip(SkipReason.UNREACHABLE, f"GET {url}: {kind}"))
        if len(raw) > MAX_BODY_BYTES:
            return _Fetched(
                failure=Skip(SkipReason.UNPARSEABLE, f"GET {url}: body over {MAX_BODY_BYTES} bytes")
            )
        return _Fetched(body=raw.decode("utf-8", errors="replace"), status=HTTP_OK)

    def _record(self, skips: tuple[Skip, ...]) -> None:
        """Count every skip; log a warning when the set of reasons changes, else debug."""
        reasons = frozenset(skip.reason for skip in skips)
        for skip in skips:
            self._metrics.samples_skipped.labels(engine=self.engine, reason=skip.reason.value).inc()
        log = logger.warning if reasons != self._last_reasons and skips else logger.debug
        for skip in skips:
            log("%s metrics skipped (%s): %s", self.engine, skip.reason.value, skip.detail)
        self._last_reasons = reasons


def _failed(now: float, skips: tuple[Skip, ...]) -> EngineSample:
    reason = "; ".join(skip.detail for skip in skips) or "no usable metrics"
    return EngineSample(metrics_present=False, scraped_at=now, reason=reason, skips=skips)
