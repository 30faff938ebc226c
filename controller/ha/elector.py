"""The leader-election interface and its SQLite implementation.

`Elector` is what the controller needs of leader election, whichever store
backend it runs on; `LeaseState` is what one read of the lease showed. On
PostgreSQL the elector is `controller.ha.leader.LeaderElector` (a lease row with a
fencing epoch); on SQLite there is a single controller, and
`SingleControllerLeader` is always the leader, with its epoch from
`Store.bump_epoch`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gearshift.controller.store.database import Store

# Election messages keep the one logger name that operators filter on.
log = logging.getLogger("gearshift.controller.ha.leader")

OnElected = Callable[[int], Awaitable[None] | None]
OnLost = Callable[[], Awaitable[None] | None]


@dataclass(frozen=True)
class LeaseState:
    """What one read of the lease showed (ages by the database clock)."""

    is_leader: bool  # this elector holds the lease for its current term
    holder: str | None  # controller id of the (last) holder; None = never held
    address: str | None  # the holder's gRPC address, for pointing clients at it
    epoch: int  # fencing epoch of the holder's term; 0 = never held
    lease_age_s: float | None  # seconds since the last renewal
    expires_in_s: float | None  # seconds until expiry; <= 0 when expired or released
    leader_for_s: float | None = None  # seconds since the holder's term began

    @property
    def live(self) -> bool:
        """True while somebody holds an unexpired lease."""
        return self.holder is not None and self.expires_in_s is not None and self.expires_in_s > 0


class Elector(Protocol):
    """What the controller needs of leader election, for either store backend."""

    controller_id: str
    address: str

    @property
    def leading_epoch(self) -> int | None: ...
    @property
    def last_state(self) -> LeaseState | None: ...
    def may_lead(self) -> bool: ...
    def try_acquire_or_renew(self) -> LeaseState: ...
    def current(self) -> LeaseState: ...
    def step_down(self) -> bool: ...
    async def run(self, on_elected: OnElected, on_lost: OnLost) -> None: ...
    def stop(self) -> None: ...
    def close(self) -> None: ...


async def call_back(callback: Callable[..., Any], *args: Any) -> None:
    """Call an `OnElected` / `OnLost` hook and await what it returns when that is awaitable."""
    result = callback(*args)
    if inspect.isawaitable(result):
        await result


class SingleControllerLeader:
    """SQLite: one controller, always the leader; the epoch comes from `Store.bump_epoch`."""

    def __init__(self, store: Store, controller_id: str, address: str, *,
                 owns_store: bool = False) -> None:
        self.store = store
        self.controller_id = controller_id
        self.address = address
        self._owns_store = owns_store
        self._epoch: int | None = None
        self._stop_event: asyncio.Event | None = None
        self._stop_requested = False
        log.info("store %s is SQLite: single controller, always the leader; "
                 "HA with several controllers needs PostgreSQL (postgresql+psycopg://…)",
                 store.url)

    @property
    def leading_epoch(self) -> int | None:
        return self._epoch

    @property
    def last_state(self) -> LeaseState | None:
        return self._state()

    def may_lead(self) -> bool:
        return self._epoch is not None

    def _state(self) -> LeaseState:
        if self._epoch is None:
            return LeaseState(False, None, None, 0, None, None)
        # never expires: expires_in_s is infinity
        return LeaseState(True, self.controller_id, self.address, self._epoch, 0.0, math.inf)

    def try_acquire_or_renew(self) -> LeaseState:
        """Leader at once; the first call of a term bumps the store's epoch."""
        if self._epoch is None:
            self._epoch = self.store.bump_epoch()
        return self._state()

    def current(self) -> LeaseState:
        return self._state()

    def step_down(self) -> bool:
        """End the term; the next `try_acquire_or_renew` starts one with a new epoch."""
        released, self._epoch = self._epoch is not None, None
        return released

    def stop(self) -> None:
        self._stop_requested = True
        if self._stop_event is not None:
            self._stop_event.set()

    async def run(self, on_elected: OnElected, on_lost: OnLost) -> None:
        """Lead at once and until `stop()` or cancellation."""
        self._stop_event = stop = asyncio.Event()
        if self._stop_requested:
            stop.set()
        state = await asyncio.to_thread(self.try_acquire_or_renew)
        try:
            await call_back(on_elected, state.epoch)
            await stop.wait()
        finally:
            self._stop_event = None
            self._stop_requested = False
            self.step_down()
            await call_back(on_lost)

    def close(self) -> None:
        if self._owns_store:
            self.store.close()
