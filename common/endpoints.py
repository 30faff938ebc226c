"""Several controllers, one leader: how clients find the leader.

Agents, the gateway and the CLI accept a list of controller addresses
(``--controller a:50051,b:50051``). A follower refuses what only the leader may
do with FAILED_PRECONDITION and names the leader in the trailing metadata entry
``gearshift-leader`` (empty while nobody leads). `ControllerEndpoints` keeps the
address to use: it follows such a hint at once and otherwise moves round the list.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc

from gearshift.common.errors import ConfigError
from gearshift.common.identity import LEADER_METADATA_KEY

DOWN_FOR_S = 3.0  # an address that did not answer is passed over this long


def parse_controllers(value: str | Sequence[str], what: str = "--controller") -> list[str]:
    """``"a:1,b:2"`` or ``["a:1", "b:2"]`` -> addresses, checked as HOST:PORT, duplicates dropped."""
    items = value.split(",") if isinstance(value, str) else list(value)
    out: list[str] = []
    for raw in items:
        addr = str(raw).strip()
        if not addr:
            continue
        host, sep, port = addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ConfigError(f"{what}: expected HOST:PORT, found {addr!r}")
        if addr not in out:
            out.append(addr)
    if not out:
        raise ConfigError(f"{what}: expected one or more HOST:PORT addresses, found {value!r}")
    return out


def _metadata_value(metadata: Iterable[Any] | None, key: str) -> str | None:
    for item in metadata or ():
        k, v = (item.key, item.value) if hasattr(item, "key") else item
        if k == key:
            return v.decode(errors="replace") if isinstance(v, bytes) else str(v)
    return None


def leader_hint(err: BaseException) -> str | None:
    """The leader's address named by a follower's refusal; "" when it knows of none;
    None when `err` is not such a refusal."""
    if not isinstance(err, grpc.RpcError):
        return None
    try:
        code = err.code()  # type: ignore[attr-defined]
        trailing = err.trailing_metadata()  # type: ignore[attr-defined]
    except Exception:  # an RpcError without call details
        return None
    if code != grpc.StatusCode.FAILED_PRECONDITION:
        return None
    return _metadata_value(trailing, LEADER_METADATA_KEY)


class ControllerEndpoints:
    """The address to talk to now, among the configured ones and the leader's hints."""

    def __init__(self, addresses: str | Sequence[str], what: str = "--controller",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.addresses = parse_controllers(addresses, what)
        self._index = 0
        self._hinted: str | None = None
        self._clock = clock
        self._down: dict[str, float] = {}  # address -> when it last failed to answer

    def _is_down(self, addr: str) -> bool:
        failed_at = self._down.get(addr)
        return failed_at is not None and self._clock() - failed_at < DOWN_FOR_S

    @property
    def current(self) -> str:
        return self._hinted or self.addresses[self._index]

    def __len__(self) -> int:
        return len(self.addresses)

    def follow(self, hint: str | None) -> bool:
        """Use the leader a follower named. False when there is no usable hint (none,
        the current address, or one that did not answer since the last success: a
        follower names a dead leader until its lease expires)."""
        if not hint or hint == self.current or self._is_down(hint):
            return False
        if hint in self.addresses:
            self._index, self._hinted = self.addresses.index(hint), None
        else:
            self._hinted = hint  # a leader advertised outside the configured list
        return True

    def succeeded(self) -> None:
        """The current address served: every address gets its chance again."""
        self._down.clear()

    def failed(self, err: BaseException | None = None) -> bool:
        """The current address did not serve: follow a leader hint in `err` if any,
        else move to the next address. True when the next try should be immediate
        (a leader was named), False when the caller should back off first."""
        hint = leader_hint(err) if err is not None else None
        if hint is None:
            self._down[self.current] = self._clock()  # not a follower's refusal: no answer
        if self.follow(hint):
            return True
        if self._hinted is not None:
            self._hinted = None
            return False
        n = len(self.addresses)
        others = [(self._index + step) % n for step in range(1, n)]
        # The next other address that has not just failed; when all have, the next one.
        self._index = next((i for i in others if not self._is_down(self.addresses[i])),
                           others[0] if others else self._index)
        return False
