"""Leader election of HA controllers: a lease row in PostgreSQL with a fencing epoch.

Several controllers share one PostgreSQL database; the one holding the lease row
(`LeaderLeaseRow`, table ``leader_lease``; it and its SQL are in
`controller.ha.lease_table`) leads. `LeaderElector` talks to the database over its
own dedicated, unpooled connection (NullPool; never the store's pool, so a busy
pool cannot delay a renewal), with a statement timeout well under the TTL. One
`try_acquire_or_renew()` is one transaction that locks the row (``SELECT … FOR
UPDATE``) and then either renews it (same holder, same epoch, not expired), takes
it over (expired or released: the epoch becomes one more than both the lease's
and the store's ``settings.epoch``, which is kept in step so nothing that reads
it ever sees the epoch go back), or leaves it alone.
Every time, ``renewed_at`` and ``expires_at`` come from the DATABASE clock
(``now()``), never from Python, so controllers need no synchronised clocks.

Step-down margin. A renewal sent at local monotonic time ``t_send`` makes the
database set ``expires_at = now() + ttl``, where ``now()`` is the start of that
transaction, which comes after ``t_send``. So the lease cannot be taken before
``t_send + ttl`` in real time. The leader acts only until its LOCAL deadline
``t_send + ttl - margin`` of the last renewal that succeeded; when that passes
without a newer success (database down, network gone, statement stuck), or when
a renewal fails, `run()` calls ``on_lost`` and stops leading — at least
``margin`` seconds before anyone else can take over, as long as the leader's
monotonic clock and the database clock advance at rates within ``margin / ttl``
of each other (25 % with the defaults) and the database clock is not stepped
forward. The fencing epoch, which agents check on every command, is the backstop
for anything beyond that.

SQLite has a single controller: `LeaderElector.for_url` on a ``sqlite:`` URL gives
a `SingleControllerLeader` (always leader, epoch from `Store.bump_epoch`) with the
same interface (`Elector`, in `controller.ha.elector`), and logs that HA needs PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.pool import NullPool

from gearshift.common.errors import ConfigError, GearshiftError, Unavailable
from gearshift.controller.ha import lease_table
from gearshift.controller.ha.elector import (
    Elector,
    LeaseState,
    OnElected,
    OnLost,
    SingleControllerLeader,
    call_back,
)
from gearshift.controller.ha.lease_table import LeaderLeaseRow
from gearshift.controller.store.database import SUPPORTED_URLS, Store
from gearshift.controller.store.tables import SETTING_EPOCH

log = logging.getLogger(__name__)

DEFAULT_LEASE_NAME = "controller"
DEFAULT_TTL_S = 10.0
DEFAULT_RENEW_EVERY_S = 2.0
STEP_DOWN_MARGIN_FRACTION = 0.25  # default margin = this share of the TTL
MIN_CONNECT_TIMEOUT_S = 2  # libpq treats anything lower as 2 s
RELEASE_WAIT_S = 5.0  # how long run() waits to release the lease when it stops


def default_controller_id() -> str:
    """``<hostname>-<pid>-<random>``: unique per controller process."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _backend(url: str) -> sa.URL:
    try:
        parsed = sa.make_url(url)
    except (sa.exc.ArgumentError, ValueError):
        raise ConfigError(f"leader election: database URL is not a valid URL; "
                          f"supported: {SUPPORTED_URLS}") from None
    if parsed.drivername in ("sqlite", "sqlite+pysqlite"):
        return parsed
    if parsed.drivername in ("postgresql", "postgresql+psycopg"):
        return parsed.set(drivername="postgresql+psycopg")
    raise ConfigError(f"leader election: unsupported database URL scheme "
                      f"{parsed.drivername!r}; supported: {SUPPORTED_URLS}")


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value <= 0:
        raise ConfigError(f"leader election: {name} must be a positive number of seconds, "
                          f"got {value!r}")
    return float(value)


class LeaderElector:
    """Lease-based leader election on PostgreSQL (see the module docstring).

    Thread-safe; `run()` does the database work in a worker thread so that the
    event loop keeps its local deadline even when a statement hangs.
    """

    def __init__(self, url: str, controller_id: str, address: str, *,
                 ttl_s: float = DEFAULT_TTL_S, renew_every_s: float = DEFAULT_RENEW_EVERY_S,
                 step_down_margin_s: float | None = None,
                 statement_timeout_s: float | None = None, poll_s: float | None = None,
                 name: str = DEFAULT_LEASE_NAME,
                 clock: Callable[[], float] = time.monotonic) -> None:
        parsed = _backend(url)
        if parsed.drivername.startswith("sqlite"):
            raise ConfigError("leader election needs PostgreSQL (postgresql+psycopg://…); "
                              "use LeaderElector.for_url for a single controller on SQLite")
        for what, value in (("controller_id", controller_id), ("name", name)):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"leader election: {what} must be a non-empty string, "
                                  f"got {value!r}")
        self.ttl_s = _positive("ttl_s", ttl_s)
        self.renew_every_s = _positive("renew_every_s", renew_every_s)
        self.step_down_margin_s = _positive(
            "step_down_margin_s", self.ttl_s * STEP_DOWN_MARGIN_FRACTION
            if step_down_margin_s is None else step_down_margin_s)
        lead_s = self.ttl_s - self.step_down_margin_s  # how long one renewal lets us lead
        if self.renew_every_s >= lead_s:
            raise ConfigError(
                f"leader election: renew_every_s ({self.renew_every_s:g}) must be less than "
                f"ttl_s - step_down_margin_s ({self.ttl_s:g} - {self.step_down_margin_s:g} "
                f"= {lead_s:g}), or the leader would step down between renewals")
        self.statement_timeout_s = _positive(
            "statement_timeout_s", min(self.renew_every_s, lead_s / 2)
            if statement_timeout_s is None else statement_timeout_s)
        if self.statement_timeout_s >= lead_s:
            raise ConfigError(
                f"leader election: statement_timeout_s ({self.statement_timeout_s:g}) must be "
                f"less than ttl_s - step_down_margin_s ({lead_s:g})")
        self.poll_s = _positive("poll_s", min(self.renew_every_s, self.step_down_margin_s) / 4
                                if poll_s is None else poll_s)
        self.controller_id = controller_id
        self.address = address
        self.name = name
        self.url = parsed.render_as_string(hide_password=True)
        self.last_loss_reason: str | None = None  # why run() last called on_lost
        self._clock = clock
        timeout_ms = max(1, round(self.statement_timeout_s * 1000))
        self._engine = sa.create_engine(parsed, poolclass=NullPool, connect_args={
            "connect_timeout": max(MIN_CONNECT_TIMEOUT_S, math.ceil(self.statement_timeout_s)),
            "application_name": f"gearshift-leader:{controller_id}"[:63],
            "options": f"-c statement_timeout={timeout_ms} -c lock_timeout={timeout_ms}",
            "tcp_user_timeout": timeout_ms,
        })
        self._conn: Connection | None = None
        self._io_lock = threading.Lock()  # one statement at a time on the dedicated connection
        self._state_lock = threading.Lock()  # never held during I/O
        self._term_epoch: int | None = None  # epoch of the term we hold and may renew
        self._last_epoch: int | None = None  # epoch of our latest term, even if forfeited
        self._generation = 0  # bumped on every forfeit; a result from before it is stale
        self._hold_off_until = -math.inf  # after step_down: let another controller take over
        self._leading: int | None = None  # epoch run() currently acts under
        self._deadline = -math.inf  # local monotonic time at which run() must stop leading
        self._stop_event: asyncio.Event | None = None
        self._stop_requested = False
        self._last_state: LeaseState | None = None

    @classmethod
    def for_url(cls, url: str, controller_id: str, address: str, *, store: Store | None = None,
                **options: Any) -> Elector:
        """A `LeaderElector` for PostgreSQL, a `SingleControllerLeader` for SQLite.

        On SQLite `store` (opened on `url` when not given) supplies the epoch.
        """
        if _backend(url).drivername.startswith("sqlite"):
            return SingleControllerLeader(store or Store.open(url), controller_id, address,
                                          owns_store=store is None)
        return cls(url, controller_id, address, **options)

    @property
    def leading_epoch(self) -> int | None:
        """The epoch `run()` currently leads under; None while it does not lead."""
        return self._leading

    @property
    def last_state(self) -> LeaseState | None:
        """The lease as the latest renewal or read showed it (no database round trip)."""
        return self._last_state

    def may_lead(self) -> bool:
        """True while `run()` leads and its local deadline has not passed. Checked
        before acting, so that a leader resuming after a pause (SIGSTOP, a long GC,
        a stalled VM) does nothing before `run()` has noticed that its term ended."""
        return (self._leading is not None and self._term_epoch == self._leading
                and self._clock() < self._deadline)

    # -- database (blocking; one statement at a time) -----------------------------

    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn = self._engine.connect()
        return self._conn

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.invalidate()
                conn.close()

    def _unavailable(self, what: str, err: sa.exc.SQLAlchemyError) -> Unavailable:
        self._drop_connection()
        cause = getattr(err, "orig", None) or err
        detail = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        return Unavailable(f"leader lease {self.name!r} on {self.url}: {what} failed: {detail}")

    def try_acquire_or_renew(self) -> LeaseState:
        """Renew our lease, or take over an expired/released one, in one transaction.

        Raises `Unavailable` when the database cannot be reached or does not answer
        within the statement timeout.
        """
        with self._io_lock:
            with self._state_lock:
                generation, renew, own = self._generation, self._term_epoch, self._last_epoch
            held_off = self._clock() < self._hold_off_until
            try:
                conn = self._connection()
                with conn.begin():
                    if held_off:
                        return lease_table.read_lease(conn, self.name, False)
                    conn.execute(lease_table.ENSURE, {"name": self.name})
                    row = conn.execute(lease_table.LOCK, {"name": self.name}).one()
                    mine = row.holder == self.controller_id
                    epoch: int | None = None
                    if mine and row.live and renew is not None and row.epoch == renew:
                        conn.execute(lease_table.RENEW, {"name": self.name, "ttl": self.ttl_s})
                        epoch = renew
                    elif not row.live or (mine and own is not None and row.epoch == own):
                        epoch = max(int(row.epoch), lease_table.store_epoch(conn)) + 1
                        conn.execute(lease_table.TAKE, {
                            "name": self.name, "me": self.controller_id,
                            "address": self.address, "epoch": epoch, "ttl": self.ttl_s})
                        conn.execute(lease_table.SAVE_EPOCH,
                                     {"key": SETTING_EPOCH, "epoch": epoch})
                    state = lease_table.read_lease(conn, self.name, epoch is not None)
            except sa.exc.SQLAlchemyError as err:
                raise self._unavailable("renewal", err) from None
            if epoch is None:
                self._last_state = state
                return state
            with self._state_lock:
                if generation != self._generation:  # forfeited while we talked: not ours now
                    self._last_state = replace(state, is_leader=False)
                    return self._last_state
                if epoch != renew:
                    log.info("controller %s took the lease %r, epoch %d", self.controller_id,
                             self.name, epoch)
                self._term_epoch = self._last_epoch = epoch
            self._last_state = state
            return state

    def current(self) -> LeaseState:
        """The lease as it stands (for followers and `controller status`); writes nothing."""
        with self._io_lock:
            try:
                conn = self._connection()
                with conn.begin():
                    state = lease_table.read_lease(conn, self.name, False)
            except sa.exc.SQLAlchemyError as err:
                raise self._unavailable("reading the lease", err) from None
        with self._state_lock:
            mine = (state.holder == self.controller_id and state.live
                    and state.epoch == self._term_epoch)
        self._last_state = replace(state, is_leader=mine)
        return self._last_state

    def _forfeit(self) -> int | None:
        with self._state_lock:
            self._generation += 1
            self._term_epoch = None
            return self._last_epoch

    def _release(self, epoch: int | None) -> bool:
        if epoch is None:
            return False
        with self._io_lock:
            try:
                conn = self._connection()
                with conn.begin():
                    res = conn.execute(lease_table.RELEASE, {
                        "name": self.name, "me": self.controller_id, "epoch": epoch})
            except sa.exc.SQLAlchemyError as err:
                log.warning("%s", self._unavailable("releasing the lease", err).message)
                return False
        return bool(res.rowcount)

    def step_down(self) -> bool:
        """Stop leading and release the lease (expires_at = now()) so that another
        controller takes over at once; this elector then stays a follower for one TTL.
        False when there was nothing to release or the database could not be reached.
        `run()` calls on_lost within `poll_s`.
        """
        epoch = self._forfeit()
        self._hold_off_until = self._clock() + self.ttl_s
        return self._release(epoch)

    def close(self) -> None:
        """Close the dedicated connection (the lease simply expires if still held)."""
        with self._io_lock:
            self._drop_connection()
        self._engine.dispose()

    # -- the loop ----------------------------------------------------------------------

    def stop(self) -> None:
        """Make `run()` return (after on_lost and releasing the lease if it leads)."""
        self._stop_requested = True
        if self._stop_event is not None:
            self._stop_event.set()

    async def _lose(self, on_lost: OnLost, reason: str) -> None:
        epoch, self._leading = self._leading, None
        self._forfeit()
        self.last_loss_reason = reason
        log.warning("controller %s stops leading (epoch %s): %s", self.controller_id, epoch,
                    reason)
        await call_back(on_lost)

    async def _settle(self, attempt: asyncio.Future[LeaseState], sent_at: float,
                      on_elected: OnElected, on_lost: OnLost) -> None:
        try:
            state = attempt.result()
        except GearshiftError as err:
            if self._leading is not None:
                await self._lose(on_lost, f"renewal failed: {err.message}")
            else:
                log.warning("%s", err.message)
            return
        if not state.is_leader:
            if self._leading is not None:
                await self._lose(on_lost, f"lease held by {state.holder} (epoch {state.epoch})")
            return
        if self._leading is not None and self._leading != state.epoch:
            await self._lose(on_lost, f"epoch moved from {self._leading} to {state.epoch}")
        self._deadline = sent_at + self.ttl_s - self.step_down_margin_s
        if self._leading is None:
            self._leading = state.epoch
            await call_back(on_elected, state.epoch)

    async def run(self, on_elected: OnElected, on_lost: OnLost) -> None:
        """Renew every `renew_every_s` until `stop()` or cancellation.

        Calls ``on_elected(epoch)`` when this controller becomes leader and
        ``on_lost()`` when it must stop (renewal failed, lease lost, local
        deadline passed, stopped). Keep both quick: start work, do not run it.
        """
        self._stop_event = stop = asyncio.Event()
        if self._stop_requested:
            stop.set()
        stopping = asyncio.ensure_future(stop.wait())
        attempt: asyncio.Future[LeaseState] | None = None
        sent_at = next_at = self._clock()
        try:
            while not stop.is_set():
                now = self._clock()
                if self._leading is not None and (now >= self._deadline
                                                  or self._term_epoch is None):
                    await self._lose(on_lost, "stepped down" if self._term_epoch is None else
                                     f"no successful renewal for "
                                     f"{self.ttl_s - self.step_down_margin_s:g} s")
                if attempt is None and now >= next_at:
                    sent_at = now
                    attempt = asyncio.ensure_future(asyncio.to_thread(self.try_acquire_or_renew))
                wake = now + self.poll_s if attempt is not None else next_at
                if self._leading is not None:
                    wake = min(wake, self._deadline)
                waits: set[asyncio.Future[Any]] = {stopping}
                if attempt is not None:
                    waits.add(attempt)
                await asyncio.wait(waits, timeout=min(max(wake - now, 0.0), self.poll_s),
                                   return_when=asyncio.FIRST_COMPLETED)
                if attempt is not None and attempt.done():
                    done, attempt = attempt, None
                    # A follower asks twice as often: it takes over sooner after expiry.
                    next_at = sent_at + (self.renew_every_s if self._leading is not None
                                         else self.renew_every_s / 2)
                    await self._settle(done, sent_at, on_elected, on_lost)
        finally:
            stopping.cancel()
            if attempt is not None:
                attempt.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._stop_event = None
            self._stop_requested = False
            if self._leading is not None:
                await self._lose(on_lost, "elector stopped")
                with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.to_thread(self._release, self._last_epoch),
                                           RELEASE_WAIT_S)


__all__ = ["DEFAULT_LEASE_NAME", "DEFAULT_RENEW_EVERY_S", "DEFAULT_TTL_S", "MIN_CONNECT_TIMEOUT_S",
           "RELEASE_WAIT_S", "STEP_DOWN_MARGIN_FRACTION", "Elector", "LeaderElector",
           "LeaderLeaseRow", "LeaseState", "OnElected", "OnLost", "SingleControllerLeader",
           "default_controller_id"]
