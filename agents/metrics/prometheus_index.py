"""A quick pass over Prometheus text in its usual strict form: every line checked, and a
series' samples read only when they are looked up.

A vLLM page is ~500 lines, of which the agent reads ~80 (three latency histograms, a
few counters and gauges). `prometheus_client`'s parser reads every label of every
line character by character, ~8 ms a page: with 8 engines scraped every 5 s, the
larger part of the agent's CPU. Here each line is matched once against a compiled
form; the labels and values of the names looked up are then read from their match.
A scraper keeps a `LineCache` per endpoint: a line its previous page had is taken as
read then (most of a page repeats from one scrape to the next), so a page costs a
dictionary look-up per unchanged line; and when every line the reader looked up on
the previous page is there unchanged (`IndexedSeries.same_reads`), the reader's
snapshot of that page stands (`prometheus_text.parse_prometheus_text`).

The strict form is a subset of what the library accepts: legacy names; labels
`name="value"` (no `__` prefix, no repeat) with the escapes `\\\\`, `\\"`, `\\n`; one
value, no timestamp, no exemplar; comments other than `# HELP NAME …` and
`# TYPE NAME counter|gauge|histogram|summary` must not start with HELP or TYPE. For
any other text `index_samples` returns None and the caller parses it with the
library, so what is accepted or refused, and the message naming a bad line, are
unchanged. Samples are the library's: by name without `_total`, in page order, a
repeated (name, labels) keeping its first place and its last value. Which samples
count as repeats can depend on the order of `# TYPE NAME counter` lines (the library
renames NAME's samples NAME_total within its family only): a name with a repeated
label set that is written both with and without `_total`, or typed as such a counter,
is read from the library's parse of the whole page.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

Labels = tuple[tuple[str, str], ...]
Series = list[tuple[Labels, float]]

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL_NAME = r"(?:[a-zA-Z][a-zA-Z0-9_]*|_[a-zA-Z0-9][a-zA-Z0-9_]*)"  # `__…` is reserved
_LABEL_VALUE = r'"[^"\\\n]*(?:\\[\\"n][^"\\\n]*)*"'
_LABEL = f"{_LABEL_NAME}={_LABEL_VALUE}"
_VALUE = r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|Inf|inf|NaN|nan)"
_SAMPLE = re.compile(rf"({_NAME})(\{{(?:{_LABEL}(?:,{_LABEL})*)?\}})? +({_VALUE})")
_LABEL_PAIR = re.compile(f"({_LABEL_NAME})=({_LABEL_VALUE})")
_ESCAPE = re.compile(r'\\([\\"n])')
_UNESCAPED = {"\\": "\\", '"': '"', "n": "\n"}
_HELP_OR_TYPE = re.compile(
    rf"# (?:HELP {_NAME}(?: .*)?|TYPE ({_NAME}) (counter|gauge|histogram|summary))")
_OTHER_COMMENT = re.compile(r"#(?: (?!(?:HELP|TYPE)(?:\s|$)).*)?")

COUNTER_SUFFIX = "_total"
MAX_CACHED_LINES = 20_000  # a vLLM page has ~500 lines; one with many LoRA adapters, more


class SampleLine:
    """One sample line in the strict form: its name without `_total` and its match; the
    written name, labels and value are read the first time the name is looked up."""

    __slots__ = ("_read", "key", "match")

    def __init__(self, key: str, match: re.Match[str]) -> None:
        self.key = key
        self.match = match
        self._read: tuple[str, Labels, float] | None = None

    def read(self) -> tuple[str, Labels, float]:
        if self._read is None:
            match = self.match
            self._read = (match.group(1), _labels(match.group(2)), _value(match.group(3)))
        return self._read


class OtherLine:
    """A blank line or a comment; `bare_counter`: NAME of `# TYPE NAME counter` (NAME
    without `_total`), else None."""

    __slots__ = ("bare_counter",)

    def __init__(self, bare_counter: str | None = None) -> None:
        self.bare_counter = bare_counter


_PLAIN = OtherLine()


class LineCache:
    """The lines of one endpoint's latest page as `index_samples` read them.

    An engine's page changes little between two scrapes (an idle engine's, only its
    process gauges): a line found here is taken as it was read, without matching it
    again or re-reading its labels. It holds the latest page's lines only, and none of
    a page over `MAX_CACHED_LINES` distinct lines.
    """

    __slots__ = ("lines", "reading")

    def __init__(self) -> None:
        self.lines: dict[str, SampleLine | OtherLine] = {}
        # What was read of the latest page, kept by the reader (`IndexedSeries.same_reads`).
        self.reading: object = None


@dataclass
class PageIndex:
    samples: dict[str, list[SampleLine]] = field(default_factory=lambda: defaultdict(list))
    bare_counters: set[str] = field(default_factory=set)  # `# TYPE NAME counter`, NAME sans _total


def index_samples(text: str, cache: LineCache | None = None) -> PageIndex | None:
    """Each sample line, by name without `_total`, in page order; None when a line is
    outside the strict form. With `cache`, lines of its page are not read again, and
    the cache then holds this page's lines (a page outside the strict form leaves it)."""
    index = PageIndex()
    samples = index.samples
    previous = cache.lines if cache is not None else {}
    seen: dict[str, SampleLine | OtherLine] = {}
    for raw in text.split("\n"):  # as the library reads it: lines end at "\n" only
        line = previous.get(raw)
        if line is None:
            line = seen.get(raw)
            if line is None:
                line = _read_line(raw)
                if line is None:
                    return None
        seen[raw] = line
        if isinstance(line, SampleLine):
            samples[line.key].append(line)
        elif line.bare_counter is not None:
            index.bare_counters.add(line.bare_counter)
    if cache is not None:  # a page far larger than an engine's is not kept between scrapes
        cache.lines = seen if len(seen) <= MAX_CACHED_LINES else {}
    return index


def _read_line(raw: str) -> SampleLine | OtherLine | None:
    """One line as the strict form reads it; None when it is outside that form."""
    line = raw.strip()
    if not line:
        return _PLAIN
    if line[0] == "#":
        described = _HELP_OR_TYPE.fullmatch(line)
        if described is None:
            return _PLAIN if _OTHER_COMMENT.fullmatch(line) is not None else None
        if described.group(2) == "counter" and not described.group(1).endswith(COUNTER_SUFFIX):
            return OtherLine(described.group(1))
        return _PLAIN
    sample = _SAMPLE.fullmatch(line)
    if sample is None:
        return None
    labels = sample.group(2)
    if labels and labels.count('="') > 1:
        names = [name for name, _ in _LABEL_PAIR.findall(labels)]
        if len(set(names)) != len(names):
            return None  # a repeated label: the library refuses the line
    return SampleLine(sample.group(1).removesuffix(COUNTER_SUFFIX), sample)


def _labels(written: str | None) -> Labels:
    if not written:
        return ()
    return tuple(sorted(
        (name, _ESCAPE.sub(lambda m: _UNESCAPED[m.group(1)], value[1:-1]) if "\\" in value
         else value[1:-1])
        for name, value in _LABEL_PAIR.findall(written)))


def _value(written: str) -> float:
    try:  # as the library reads it: "-0" is 0.0, not -0.0
        return float(int(written))
    except ValueError:
        return float(written)


class IndexedSeries(Mapping[str, Series]):
    """Series by name from `index_samples`, each read the first time it is looked up."""

    def __init__(self, index: PageIndex, whole_page: Callable[[], Mapping[str, Series]]) -> None:
        self._index = index
        self._samples = index.samples
        self._whole_page = whole_page  # the library's parse, for the rare ambiguous name
        self._read: dict[str, Series] = {}
        # Every name looked up (or asked about) and its lines; None: not on the page.
        self.looked_up: dict[str, list[SampleLine] | None] = {}
        self.used_whole_page = False

    def __getitem__(self, name: str) -> Series:
        if name not in self._read:
            lines = self._samples[name]
            self.looked_up[name] = lines
            read = [line.read() for line in lines]
            if len({labels for _, labels, _ in read}) == len(read):
                self._read[name] = [(labels, value) for _, labels, value in read]
            elif len({written for written, _, _ in read}) == 1 \
                    and name not in self._index.bare_counters:
                latest: dict[Labels, float] = {}
                for _, labels, value in read:
                    latest[labels] = value
                self._read[name] = list(latest.items())
            else:  # which repeats merge depends on where the `# TYPE` lines are
                self.used_whole_page = True
                self._read[name] = list(self._whole_page()[name])
        return self._read[name]

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        lines = self._samples.get(name)
        self.looked_up[name] = lines
        return lines is not None

    @property
    def bare_counters(self) -> frozenset[str]:
        return frozenset(self._index.bare_counters)

    def same_reads(self, looked_up: Mapping[str, list[SampleLine] | None],
                   bare_counters: frozenset[str]) -> bool:
        """This page has, for each of `looked_up`'s names, the very lines (the same
        `SampleLine` objects, in the same order) another page had, and the same bare
        counters: whatever read only those names reads the same here."""
        samples = self._samples
        return (self._index.bare_counters == bare_counters
                and all(samples.get(name) == lines for name, lines in looked_up.items()))

    def __iter__(self) -> Iterator[str]:
        return iter(self._samples)

    def __len__(self) -> int:
        return len(self._samples)
