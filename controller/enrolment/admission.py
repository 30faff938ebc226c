"""Admission to enrolment: rate limits before any costly work, and refusals summed up.

`Enrol` is served to anyone who can reach the enrolment listener. `EnrolAdmission`
admits a request by its source address's token bucket, then by the listener's, before
the token is looked at or the CSR parsed; `RefusalTally` counts refusals by kind and
source so that they are logged as one summary line per interval, not one a request.
"""

from __future__ import annotations

import urllib.parse
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum

from gearshift.common.errors import (
    GearshiftError,
    InvalidArgument,
    ResourceExhausted,
    Unauthenticated,
)
from gearshift.controller.enrolment.rules import BadToken

# Enrol is served to anyone who can reach the enrolment listener: each request is
# admitted by its source address's bucket, then by the listener's, before the token
# is looked at or the CSR parsed. A host asks once, then every 5 s while pending or
# 30 s while refused, so 5/s per address is far above any agent's need; a fleet
# starting at once is admitted at 50/s (1,000 hosts in 20 s; agents back off and retry).
ENROL_RATE_PER_SOURCE_PER_S = 5.0
ENROL_BURST_PER_SOURCE = 20.0
ENROL_RATE_TOTAL_PER_S = 50.0
ENROL_BURST_TOTAL = 100.0
MAX_TRACKED_SOURCES = 4096  # per-source buckets kept (least recently seen dropped first)
REFUSAL_LOG_INTERVAL_S = 10.0  # refused requests are logged as one summary line per interval


# -- admission: rate limits before any costly work -----------------------------------

@dataclass
class TokenBucket:
    """`rate_per_s` tokens a second, at most `burst` saved; each request takes one."""

    rate_per_s: float
    burst: float
    tokens: float
    updated: float  # a monotonic clock's seconds

    @classmethod
    def full(cls, rate_per_s: float, burst: float, now: float) -> TokenBucket:
        return cls(rate_per_s, burst, burst, now)

    def take(self, now: float) -> bool:
        elapsed = max(0.0, now - self.updated)
        self.tokens = min(self.burst, self.tokens + elapsed * self.rate_per_s)
        self.updated = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class EnrolAdmission:
    """Token buckets for enrolment requests: one per source address, one overall.

    A request is refused (ResourceExhausted) by its source's bucket first, so that
    one busy address does not spend everyone's share, then by the overall one. At
    most `max_sources` addresses are tracked; the one seen least recently goes first
    (it has had the most time to refill).
    """

    def __init__(self, *, per_source_per_s: float = ENROL_RATE_PER_SOURCE_PER_S,
                 per_source_burst: float = ENROL_BURST_PER_SOURCE,
                 total_per_s: float = ENROL_RATE_TOTAL_PER_S,
                 total_burst: float = ENROL_BURST_TOTAL,
                 max_sources: int = MAX_TRACKED_SOURCES) -> None:
        self.per_source_per_s, self.per_source_burst = per_source_per_s, per_source_burst
        self.total_per_s, self.total_burst = total_per_s, total_burst
        self.max_sources = max_sources
        self._sources: OrderedDict[str, TokenBucket] = OrderedDict()
        self._total: TokenBucket | None = None

    def admit(self, source: str, now: float) -> None:
        bucket = self._sources.pop(source, None) or TokenBucket.full(
            self.per_source_per_s, self.per_source_burst, now)
        self._sources[source] = bucket  # most recently seen last
        while len(self._sources) > self.max_sources:
            self._sources.popitem(last=False)
        if not bucket.take(now):
            raise ResourceExhausted(
                f"too many enrolment requests from {source} (at most "
                f"{self.per_source_per_s:g}/s, bursts of {self.per_source_burst:g}); "
                "ask again later")
        if self._total is None:
            self._total = TokenBucket.full(self.total_per_s, self.total_burst, now)
        if not self._total.take(now):
            raise ResourceExhausted(
                f"too many enrolment requests (at most {self.total_per_s:g}/s in all); "
                "ask again later")


def peer_source(peer: str) -> str:
    """The address part of a gRPC peer string (`ipv4:10.0.0.7:51234` -> `10.0.0.7`,
    `ipv6:[fd00::7]:51234` -> `fd00::7`); other transports are one source each."""
    kind, _, rest = peer.partition(":")
    rest = urllib.parse.unquote(rest)
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    if kind == "ipv6":
        return (rest.rpartition(":")[0] or rest).strip("[]")
    return kind or "unknown"


# -- refusals: summed up, one log line per interval ------------------------------------

class RefusalKind(StrEnum):
    """Why an enrolment request was refused, as the summary line counts it."""

    BAD_TOKEN = "bad token"            # malformed, unknown id or wrong secret
    RATE_LIMITED = "rate limited"      # EnrolAdmission
    INVALID = "invalid request"        # the CSR (or the request) is malformed
    REFUSED = "refused by the rules"   # a real token that does not allow this request


def refusal_kind(err: GearshiftError) -> RefusalKind:
    if isinstance(err, ResourceExhausted):
        return RefusalKind.RATE_LIMITED
    if isinstance(err, Unauthenticated | BadToken):
        return RefusalKind.BAD_TOKEN
    if isinstance(err, InvalidArgument):
        return RefusalKind.INVALID
    return RefusalKind.REFUSED


@dataclass
class RefusalTally:
    """Refused requests of the current interval: counts by kind, the sources, and the
    last refusal that passed the token check (what an operator may want to act on)."""

    counts: Counter[RefusalKind] = field(default_factory=Counter)
    sources: set[str] = field(default_factory=set)
    more_sources: bool = False  # more than MAX_TRACKED_SOURCES
    last_refused: str = ""

    def add(self, kind: RefusalKind, source: str, message: str) -> bool:
        """Count one refusal; True when it is the first of an interval."""
        first = not self.counts
        self.counts[kind] += 1
        if source in self.sources or len(self.sources) < MAX_TRACKED_SOURCES:
            self.sources.add(source)
        else:
            self.more_sources = True
        if kind == RefusalKind.REFUSED:
            self.last_refused = message
        return first

    def summary(self, interval_s: float) -> str | None:
        """The interval's line, and a fresh start; None when nothing was refused."""
        if not self.counts:
            return None
        kinds = ", ".join(f"{self.counts[k]} {k.value}" for k in RefusalKind if self.counts[k])
        sources = f"{'more than ' if self.more_sources else ''}{len(self.sources)} source" + \
            ("" if len(self.sources) == 1 and not self.more_sources else "s")
        line = (f"refused {sum(self.counts.values())} enrolment requests in the last "
                f"{interval_s:g} s: {kinds}, from {sources}")
        if self.last_refused:
            line += f"; the last refused by the rules: {self.last_refused}"
        self.counts, self.sources, self.more_sources, self.last_refused = \
            Counter(), set(), False, ""
        return line


__all__ = ["ENROL_BURST_PER_SOURCE", "ENROL_BURST_TOTAL", "ENROL_RATE_PER_SOURCE_PER_S",
           "ENROL_RATE_TOTAL_PER_S", "MAX_TRACKED_SOURCES", "REFUSAL_LOG_INTERVAL_S",
           "EnrolAdmission", "RefusalKind", "RefusalTally", "TokenBucket", "peer_source",
           "refusal_kind"]
