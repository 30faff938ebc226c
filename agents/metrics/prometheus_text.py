"""Parse engine Prometheus text (every engine of the catalog) into an `EngineSnapshot`.

The text is read with `prometheus_client.parser`; this module only maps the
engines' metric names onto gearshift's fields. Names are matched on SAMPLE names,
not family names, because real scrapes are not always well formed (the
trtllm-serve excerpt in PR 5785 has buckets with no `# TYPE` line, which the
library reads as untyped families of one sample each).

Which names fill which field is the engine catalog's `MetricNames`
(`gearshift.common.engines`): each base name is looked up under each of the
entry's prefixes, the first prefix that has it wins, so nothing is counted
twice; of several base names for one field, the first present wins (so an older
name such as vLLM's `time_per_output_token_seconds` is used only when the new
one is absent). Counters are read with or without `_total`; a finished-requests
counter is summed over `finished_reason` (reasons in `ERROR_FINISH_REASONS` also
count as errors) unless the entry names a separate error counter. Without an
engine, every catalog entry's names are tried.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from prometheus_client.parser import text_string_to_metric_families

from gearshift.agents.metrics.model import (
    EngineSnapshot,
    Histogram,
    MetricsParseError,
    Skip,
    SkipReason,
    SleepState,
)
from gearshift.agents.metrics.prometheus_index import (
    IndexedSeries,
    LineCache,
    SampleLine,
    index_samples,
)
from gearshift.common.engines import MetricNames, any_engine_metric_names

COUNTER_SUFFIX = "_total"
ERROR_FINISH_REASONS = frozenset({"abort", "error"})
MAX_QUOTED_LINE_CHARS = 80

Labels = tuple[tuple[str, str], ...]
Series = list[tuple[Labels, float]]


def parse_prometheus_text(text: str, *, source: str = "/metrics",
                          names: MetricNames | None = None,
                          cache: LineCache | None = None) -> EngineSnapshot:
    """Read one Prometheus text scrape; raise `MetricsParseError` if it is not that format.

    Series with unusable values (NaN, ±Inf, negative, bad `le`) are dropped and
    listed in `EngineSnapshot.skips`; the rest of the scrape is still used.
    `cache`: the lines of the previous scrape of the same endpoint, read
    (`prometheus_index.LineCache`), and what was looked up in them: when every line
    looked up then is there unchanged, that scrape's snapshot is this one's. The
    result is the same with or without it.
    """
    if not isinstance(text, str):
        raise MetricsParseError(f"{source}: expected text, got {type(text).__name__}")
    series = _read_series(text, source, cache)
    last = cache.reading if cache is not None else None
    if (isinstance(series, IndexedSeries) and isinstance(last, _Reading)
            and last.names is names and last.source == source
            and series.same_reads(last.looked_up, last.bare_counters)):
        return last.snapshot  # every line read last time is there, unchanged
    reader = _Reader(series, source, names or any_engine_metric_names())
    snapshot = replace(reader.engine_snapshot(), skips=tuple(reader.skips))
    if cache is not None:
        cache.reading = (_Reading(names, source, series.looked_up, series.bare_counters, snapshot)
                         if isinstance(series, IndexedSeries) and not series.used_whole_page
                         else None)
    return snapshot


@dataclass(frozen=True)
class _Reading:
    """What one page's snapshot was read from: the lines of each name looked up."""

    names: MetricNames | None
    source: str
    looked_up: Mapping[str, list[SampleLine] | None]
    bare_counters: frozenset[str]
    snapshot: EngineSnapshot


def _read_series(text: str, source: str, cache: LineCache | None) -> Mapping[str, Series]:
    """All samples by sample name without `_total`; a repeated (name, labels) keeps the last.

    A page in the usual strict form is indexed and a name's samples read when the
    reader looks them up (`prometheus_index`); any other text goes through the library.
    """
    samples = index_samples(text, cache)
    if samples is None:
        return _parse_series(text, source)
    return IndexedSeries(samples, lambda: _parse_series(text, source))


def _parse_series(text: str, source: str) -> dict[str, Series]:
    """`_read_series` by the library, every line.

    The library names counter samples `NAME_total` even when the text wrote `NAME`,
    so counters are looked up without the suffix.
    """
    latest: dict[tuple[str, Labels], float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = tuple(sorted(sample.labels.items()))
                latest[(sample.name, labels)] = float(sample.value)
    except Exception as exc:  # the library raises ValueError and others on bad text
        raise MetricsParseError(_describe_bad_text(text, source, exc)) from exc
    by_name: dict[str, Series] = defaultdict(list)
    for (name, labels), value in latest.items():
        by_name[name.removesuffix(COUNTER_SUFFIX)].append((labels, value))
    return by_name


def _describe_bad_text(text: str, source: str, exc: Exception) -> str:
    """Name the first line the library rejects on its own, if there is one."""
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            list(text_string_to_metric_families(line + "\n"))
        except Exception as line_exc:
            quoted = (
                line if len(line) <= MAX_QUOTED_LINE_CHARS else line[:MAX_QUOTED_LINE_CHARS] + "…"
            )
            return f"{source}: not Prometheus text at line {number} ({quoted!r}): {line_exc}"
    return f"{source}: not Prometheus text: {exc}"


class _Reader:
    """Looks samples up by engine name, validating only the series it uses."""

    def __init__(self, series: Mapping[str, Series], source: str, names: MetricNames) -> None:
        self._series = series
        self._names = names
        self._source = source
        self.skips: list[Skip] = []

    def _skip(self, reason: SkipReason, name: str, labels: Labels, value: float | str) -> None:
        shown = ",".join(f'{key}="{val}"' for key, val in labels)
        self.skips.append(Skip(reason, f"{self._source}: {name}{{{shown}}} = {value}"))

    def _valid(self, name: str, labels: Labels, value: float) -> bool:
        if math.isnan(value) or math.isinf(value):
            self._skip(SkipReason.NON_FINITE, name, labels, value)
            return False
        if value < 0:
            self._skip(SkipReason.NEGATIVE, name, labels, value)
            return False
        return True

    def _lookup(self, *names: str) -> tuple[str, Series] | None:
        """The first of `names` under the first prefix that has it."""
        for name in names:
            for prefix in self._names.prefixes:
                full = prefix + name
                if full in self._series:
                    return full, self._series[full]
        return None

    def _sum(
        self, found: tuple[str, Series] | None, keep: Iterable[Labels] | None = None
    ) -> float | None:
        if found is None:
            return None
        name, series = found
        allowed = set(keep) if keep is not None else None
        values = [
            value
            for labels, value in series
            if (allowed is None or labels in allowed) and self._valid(name, labels, value)
        ]
        return self._finite_total(name, values)

    def _finite_total(self, name: str, values: list[float]) -> float | None:
        """The sum of `values`; None (with a skip) when there are none or it overflows."""
        if not values:
            return None
        total = sum(values)
        if math.isinf(total):
            self._skip(SkipReason.NON_FINITE, name, (), "overflow when summed")
            return None
        return total

    def engine_snapshot(self) -> EngineSnapshot:
        n = self._names
        success = self._lookup(*n.finished)
        error_counter = self._lookup(*n.errors) if n.errors else None
        errors: float | None = None
        if error_counter is not None and success is not None:
            errors = self._sum(error_counter)
        elif success is not None:
            error_labels = [
                labels
                for labels, _ in success[1]
                if dict(labels).get("finished_reason") in ERROR_FINISH_REASONS
            ]
            errors = self._sum(success, error_labels) if error_labels else 0.0
        preemptions = self._lookup(*n.preemptions)
        hits, queries = self._prefix_cache()
        counters = (("requests_finished", success),
                    ("prompt_tokens", self._lookup("prompt_tokens")),
                    ("generation_tokens", self._lookup("generation_tokens")),
                    ("preemptions", preemptions),
                    ("prefix_cache_hits", hits),
                    ("prefix_cache_queries", queries))
        usage = self._kv_fraction()
        blocks_total = self._sum(self._lookup(*n.kv_blocks_total))
        if blocks_total is None:
            blocks_total = self._info_label_total(n.cache_config_info, "num_gpu_blocks")
        blocks_used = self._sum(self._lookup(*n.kv_blocks_used))
        if blocks_used is None and blocks_total is not None and usage is not None:
            blocks_used = float(round(usage * blocks_total))
        if blocks_total is not None and blocks_used is not None and blocks_used > blocks_total:
            self._skip(SkipReason.OUT_OF_RANGE, "kv blocks used", (),
                       f"{blocks_used:g} > total {blocks_total:g}")
            blocks_used = None
        return EngineSnapshot(
            counter_series=tuple((name, tuple(found[1])) for name, found in counters
                                 if found is not None),
            requests_finished=self._sum(success),
            request_errors=errors,
            prompt_tokens=self._sum(self._lookup(*n.prompt_tokens)),
            generation_tokens=self._sum(self._lookup(*n.generation_tokens)),
            running=self._sum(self._lookup(*n.running)),
            waiting=self._sum(self._lookup(*n.waiting)),
            kv_cache_usage=usage,
            ttft=self._histogram(*n.ttft),
            itl=self._histogram(*n.itl),
            e2e=self._histogram(*n.e2e),
            queue_time=self._histogram(*n.queue_time),
            preemptions=self._sum(preemptions),
            prefix_cache_hits=self._sum(hits),
            prefix_cache_queries=self._sum(queries),
            prefix_cache_hit_rate=self._mean_fraction(*n.prefix_cache_hit_rate),
            sleep_state=self._sleep_state(),
            prompt_length=self._histogram(*n.prompt_length),
            generation_length=self._histogram(*n.generation_length),
            kv_blocks_total=blocks_total,
            kv_blocks_used=blocks_used,
        )

    def _prefix_cache(self) -> tuple[tuple[str, Series] | None, tuple[str, Series] | None]:
        """The hits counter and the queries counter (hits + misses where the engine
        counts misses instead of queries); both or neither."""
        n = self._names
        hits = self._lookup(*n.prefix_cache_hits)
        if hits is None:
            return None, None
        queries = self._lookup(*n.prefix_cache_queries)
        if queries is not None:
            return hits, queries
        misses = self._lookup(*n.prefix_cache_misses)
        if misses is None:
            return None, None
        total: dict[Labels, float] = defaultdict(float)
        for labels, value in (*hits[1], *misses[1]):
            total[labels] += value
        return hits, (misses[0] + "+hits", list(total.items()))

    def _mean_fraction(self, *names: str) -> float | None:
        """A gauge in [0, 1], averaged over its series (one per engine core)."""
        found = self._lookup(*names)
        if found is None:
            return None
        name, series = found
        values = [v for labels, v in series if self._valid(name, labels, v)]
        if not values or any(self._fraction(name, v) is None for v in values):
            return None
        return sum(v / len(values) for v in values)

    def _sleep_state(self) -> SleepState | None:
        """vLLM's one-hot `engine_sleep_state`; with several engine cores, the deepest sleep.

        A core whose three series are all 0 (or whose value is not 0/1) makes the
        state unknown rather than guessed.
        """
        found = self._lookup(*self._names.sleep_state)
        if found is None:
            return None
        name, series = found
        states: dict[Labels, set[SleepState]] = defaultdict(set)
        for labels, value in series:
            if not self._valid(name, labels, value):
                return None
            if value not in (0.0, 1.0):
                self._skip(SkipReason.OUT_OF_RANGE, name, labels, value)
                return None
            label = dict(labels).get("sleep_state", "")
            core = tuple(kv for kv in labels if kv[0] != "sleep_state")
            on = states.setdefault(core, set())  # a core with every series at 0 still counts
            if value == 1.0 and label in SleepState.__members__.values():
                on.add(SleepState(label))
        if not states or any(len(on) != 1 for on in states.values()):
            return None
        seen = {state for on in states.values() for state in on}
        for deepest in (SleepState.DISCARD_ALL, SleepState.WEIGHTS_OFFLOADED):
            if deepest in seen:
                return deepest
        return SleepState.AWAKE

    def _info_label_total(self, names: tuple[str, ...], label: str) -> float | None:
        """The sum over series of a numeric label of an info gauge (vLLM's
        `cache_config_info{num_gpu_blocks="…"}`, one series per engine core)."""
        found = self._lookup(*names)
        if found is None:
            return None
        name, series = found
        total = 0.0
        for labels, _ in series:
            raw = dict(labels).get(label)
            try:
                value = float(raw) if raw is not None else math.nan
            except ValueError:
                return None  # "None" before the engine has sized its cache
            if not self._valid(name, labels, value):
                return None
            if value == 0:
                self._skip(SkipReason.OUT_OF_RANGE, name, labels, value)
                return None
            total += value
        return total if series and not math.isinf(total) else None

    def _kv_fraction(self) -> float | None:
        found = self._lookup(*self._names.kv_cache_usage)
        if found is None:
            return None
        name, series = found
        values = [v for labels, v in series if self._valid(name, labels, v)]
        # Each engine core's value is a fraction; a mean would hide one above 1.
        if len(values) > 1 and any(self._fraction(name, v) is None for v in values):
            return None
        # One value per engine core (data parallel): report their mean.
        return self._fraction(name, sum(v / len(values) for v in values)) if values else None

    def _fraction(self, name: str, value: float) -> float | None:
        if value > 1.0:
            self._skip(SkipReason.OUT_OF_RANGE, name, (), value)
            return None
        return value

    def _histogram(self, *bases: str) -> Histogram | None:
        for base in bases:
            found = self._lookup(base + "_bucket")
            if found is not None:
                prefix = found[0][: -len(base + "_bucket")]
                return self._build_histogram(prefix + base, found[1])
        return None

    def _build_histogram(self, name: str, buckets: Series) -> Histogram | None:
        by_bound: dict[float, float] = defaultdict(float)
        label_sets: set[Labels] = set()
        for labels, value in buckets:
            le = dict(labels).get("le")
            try:
                bound = float(le) if le is not None else math.nan
            except ValueError:
                bound = math.nan
            if math.isnan(bound):
                self._skip(SkipReason.BAD_LABEL, name + "_bucket", labels, value)
                return None
            if not self._valid(name + "_bucket", labels, value):
                return None  # one bad bucket makes the whole histogram unreliable
            by_bound[bound] += value
            label_sets.add(tuple(kv for kv in labels if kv[0] != "le"))
            if math.isinf(by_bound[bound]):
                self._skip(SkipReason.NON_FINITE, name + "_bucket", labels, "overflow when summed")
                return None
        count = self._sum(self._lookup_exact(name + "_count"))
        total = self._sum(self._lookup_exact(name + "_sum"))
        ordered = sorted(by_bound.items())
        if not ordered or not math.isinf(ordered[-1][0]):
            # Partial scrapes (the aibrix excerpt) stop before +Inf: use `_count`.
            last = ordered[-1][1] if ordered else 0.0
            ordered.append((math.inf, max(last, count or 0.0)))
        if count is None:
            count = ordered[-1][1]
        return Histogram(buckets=tuple(ordered), sum=total, count=count,
                         series=max(1, len(label_sets)))

    def _lookup_exact(self, name: str) -> tuple[str, Series] | None:
        return (name, self._series[name]) if name in self._series else None
