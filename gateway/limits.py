"""What one gateway process allows its clients: connections, body bytes, time.

`ClientLimits` holds the numbers (every one configurable, the defaults sized so a
gateway stays within a few hundred MB however its clients behave); `BodyBudget`
is the one counter of request-body bytes buffered across all connections, which
the listener reserves from before it buffers a body and gives back when the
request is done.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024

# Refusal reasons (label values of the refusals counter).
BAD_REQUEST, TOO_LARGE, TIMEOUT, CONNECTION_LIMIT, BODY_BUDGET = (
    "bad_request", "too_large", "timeout", "connection_limit", "body_budget")


def refusal_reason(status: int) -> str:
    """The refusals counter's reason for a request refused with `status`."""
    if status in (413, 431):
        return TOO_LARGE
    if status == 408:
        return TIMEOUT
    if status == 503:
        return BODY_BUDGET
    return BAD_REQUEST


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """Bounds on client connections; the listener enforces them, the metrics show them."""

    max_connections: int = 4096  # open client connections; more are answered 503 and closed
    body_budget_bytes: int = 128 * MIB  # request bodies buffered at once, all connections
    max_body_bytes: int = 64 * MIB  # one request body
    idle_timeout_s: float = 75.0  # a kept-alive connection with no request is closed
    head_timeout_s: float = 15.0  # from a head's first byte to its blank line
    body_grace_s: float = 10.0  # a body may arrive at any pace this long ...
    body_min_rate_bps: float = 32 * 1024  # ... then must average this many bytes a second

    def check(self) -> list[str]:
        """What is wrong with these limits (empty when they are usable)."""
        problems = []
        if self.max_connections < 1:
            problems.append(f"max connections must be >= 1, got {self.max_connections}")
        if self.body_budget_bytes < self.max_body_bytes:
            problems.append(f"the body budget ({self.body_budget_bytes} bytes) must hold at "
                            f"least one largest body ({self.max_body_bytes} bytes)")
        if self.max_body_bytes < 1:
            problems.append(f"max body bytes must be >= 1, got {self.max_body_bytes}")
        for name in ("idle_timeout_s", "head_timeout_s", "body_grace_s", "body_min_rate_bps"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        return problems


class BodyBudget:
    """Request-body bytes the listener may hold at once, shared by every connection."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> bool:
        """Reserve `n` bytes; False (and nothing reserved) when that would pass the limit."""
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n
