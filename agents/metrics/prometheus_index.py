"""A quick pass over Prometheus text in its usual strict form: every line checked, and a
series' samples read only when they are looked up.

A vLLM page is ~500 lines, of which the agent reads ~80 (three latency histograms, a
few counters and gauges). `prometheus_client`'s parser reads every label of every
line character by character, ~8 ms a page: with 8 engines scraped every 5 s, the
larger part of the agent's CPU. Here each line is matched once against a compiled
form; the labels and values of the names looked up are then read from their match.

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


@dataclass
class PageIndex:
    samples: dict[str, list[re.Match[str]]] = field(default_factory=lambda: defaultdict(list))
    bare_counters: set[str] = field(default_factory=set)  # `# TYPE NAME counter`, NAME sans _total


def index_samples(text: str) -> PageIndex | None:
    """Each sample line's match, by name without `_total`, in page order; None when a
    line is outside the strict form."""
    index = PageIndex()
    for raw in text.split("\n"):  # as the library reads it: lines end at "\n" only
        line = raw.strip()
        if not line:
            continue
        if line[0] == "#":
            described = _HELP_OR_TYPE.fullmatch(line)
            if described is None:
                if _OTHER_COMMENT.fullmatch(line) is None:
                    return None
            elif described.group(2) == "counter" and not described.group(1).endswith(
                    COUNTER_SUFFIX):
                index.bare_counters.add(described.group(1))
            continue
        sample = _SAMPLE.fullmatch(line)
        if sample is None:
            return None
        labels = sample.group(2)
        if labels and labels.count('="') > 1:
            names = [name for name, _ in _LABEL_PAIR.findall(labels)]
            if len(set(names)) != len(names):
                return None  # a repeated label: the library refuses the line
        index.samples[sample.group(1).removesuffix(COUNTER_SUFFIX)].append(sample)
    return index


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

    def __getitem__(self, name: str) -> Series:
        if name not in self._read:
            matches = self._samples[name]  # KeyError for a name the page does not have
            read = [(m.group(1), _labels(m.group(2)), _value(m.group(3))) for m in matches]
            if len({labels for _, labels, _ in read}) == len(read):
                self._read[name] = [(labels, value) for _, labels, value in read]
            elif len({written for written, _, _ in read}) == 1 \
                    and name not in self._index.bare_counters:
                latest: dict[Labels, float] = {}
                for _, labels, value in read:
                    latest[labels] = value
                self._read[name] = list(latest.items())
            else:  # which repeats merge depends on where the `# TYPE` lines are
                self._read[name] = list(self._whole_page()[name])
        return self._read[name]

    def __contains__(self, name: object) -> bool:
        return name in self._samples

    def __iter__(self) -> Iterator[str]:
        return iter(self._samples)

    def __len__(self) -> int:
        return len(self._samples)
