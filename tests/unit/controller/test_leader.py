"""Leader election on PostgreSQL (real server at 127.0.0.1:5432) and the SQLite stand-in."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest

from gearshift.common.errors import ConfigError, Unavailable
from gearshift.controller.ha.leader import (
    LeaderElector,
    LeaseState,
    SingleControllerLeader,
    default_controller_id,
)
from gearshift.controller.store.database import Store, default_sqlite_url
from gearshift.controller.store.tables import SETTING_EPOCH

from .conftest import PG_ADMIN_DSN, PG_URL_TEMPLATE

WAIT_S = 20.0  # safety net for awaiting an event; never a measured bound


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Events:
    """Records on_elected / on_lost calls of one elector, awaitable in order."""

    def __init__(self, on_lost_probe: Callable[[], Any] | None = None) -> None:
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.probe = on_lost_probe
        self.probed: list[Any] = []

    async def on_elected(self, epoch: int) -> None:
        await self.queue.put(("elected", epoch))

    def on_lost(self) -> None:
        if self.probe is not None:
            self.probed.append(self.probe())
        self.queue.put_nowait(("lost", None))

    async def next(self) -> tuple[str, Any]:
        return await asyncio.wait_for(self.queue.get(), WAIT_S)


@pytest.fixture(scope="module")
def pg_url(pg_database: str) -> Iterator[str]:
    url = PG_URL_TEMPLATE.format(db=pg_database)
    store = Store.open(url)  # the schema, leader_lease included
    yield url
    store.close()


def _connect(pg_database: str) -> psycopg.Connection:
    dsn = PG_ADMIN_DSN.replace("dbname=postgres", f"dbname={pg_database}")
    return psycopg.connect(dsn, autocommit=True)


@pytest.fixture
def admin(pg_database: str) -> Iterator[psycopg.Connection]:
    """For looking at the database from outside (each statement its own transaction)."""
    with _connect(pg_database) as conn:
        yield conn


@pytest.fixture
def locker(pg_database: str) -> Iterator[psycopg.Connection]:
    """For holding a row lock in an open transaction (a database that stops answering)."""
    with _connect(pg_database) as conn:
        yield conn


@pytest.fixture
def make(pg_url: str) -> Iterator[Callable[..., LeaderElector]]:
    """Builds electors on one fresh lease name; all closed after the test."""
    name = f"lease-{uuid.uuid4().hex[:8]}"
    made: list[LeaderElector] = []

    def _make(controller_id: str, **overrides: Any) -> LeaderElector:
        opts: dict[str, Any] = {"ttl_s": 1.0, "renew_every_s": 0.2, "step_down_margin_s": 0.3,
                                "name": name}
        opts.update(overrides)
        elector = LeaderElector(pg_url, controller_id, f"{controller_id}.example:7070", **opts)
        made.append(elector)
        return elector

    yield _make
    for elector in made:
        elector.close()


def db_expires_in_s(admin: psycopg.Connection, name: str) -> float:
    row = admin.execute("SELECT extract(epoch FROM expires_at - now()) FROM leader_lease "
                        "WHERE name = %s", (name,)).fetchone()
    assert row is not None
    return float(row[0])


def wait_for_expiry(elector: LeaderElector) -> None:
    while (left := elector.current().expires_in_s) is not None and left > 0:
        time.sleep(left + 0.02)


@pytest.mark.postgres
def test_two_electors_racing_make_exactly_one_leader(make) -> None:  # type: ignore[no-untyped-def]
    electors = [make(f"c{i}") for i in range(4)]
    barrier = threading.Barrier(len(electors))

    def attempt(e: LeaderElector) -> LeaseState:
        barrier.wait()
        return e.try_acquire_or_renew()

    with ThreadPoolExecutor(len(electors)) as pool:
        states = list(pool.map(attempt, electors))
    leaders = [s for s in states if s.is_leader]
    assert len(leaders) == 1
    assert {(s.holder, s.epoch) for s in states} == {(leaders[0].holder, leaders[0].epoch)}
    winner = next(e for e in electors if e.controller_id == leaders[0].holder)
    again = winner.try_acquire_or_renew()
    assert again.is_leader and again.epoch == leaders[0].epoch  # renewal keeps the epoch
    assert not any(e.try_acquire_or_renew().is_leader for e in electors if e is not winner)


@pytest.mark.postgres
def test_followers_see_holder_address_epoch_and_lease_age(make) -> None:  # type: ignore[no-untyped-def]
    a, b = make("a", ttl_s=5.0), make("b", ttl_s=5.0)
    empty = b.current()
    assert (empty.is_leader, empty.holder, empty.epoch, empty.live) == (False, None, 0, False)
    won = a.try_acquire_or_renew()
    seen = b.current()
    assert not seen.is_leader and seen.live
    assert (seen.holder, seen.address, seen.epoch) == ("a", "a.example:7070", won.epoch)
    assert seen.lease_age_s is not None and seen.lease_age_s >= 0
    assert seen.expires_in_s is not None and 0 < seen.expires_in_s <= 5.0
    assert seen.leader_for_s is not None and seen.leader_for_s >= seen.lease_age_s
    assert a.current().is_leader


@pytest.mark.postgres
def test_expired_lease_is_taken_over_with_next_epoch_and_stale_leader_is_fenced(  # type: ignore[no-untyped-def]
        make, pg_url: str) -> None:
    a, b = make("a"), make("b")
    first = a.try_acquire_or_renew()
    assert first.is_leader and not b.try_acquire_or_renew().is_leader
    wait_for_expiry(b)  # a stops renewing
    second = b.try_acquire_or_renew()
    assert second.is_leader and second.holder == "b" and second.epoch == first.epoch + 1
    stale = a.try_acquire_or_renew()
    assert not stale.is_leader and stale.holder == "b" and stale.epoch == second.epoch
    store = Store.open(pg_url)
    try:
        assert store.get_setting(SETTING_EPOCH) == second.epoch  # the store's epoch follows
    finally:
        store.close()


@pytest.mark.postgres
def test_step_down_lets_a_follower_take_over_at_once(make) -> None:  # type: ignore[no-untyped-def]
    a, b = make("a", ttl_s=30.0, renew_every_s=5.0), make("b", ttl_s=30.0, renew_every_s=5.0)
    first = a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew().is_leader
    assert a.step_down() is True
    second = b.try_acquire_or_renew()
    assert second.is_leader and second.epoch == first.epoch + 1
    assert not a.try_acquire_or_renew().is_leader
    assert a.step_down() is False  # nothing left to release


@pytest.mark.postgres
def test_epoch_continues_above_the_store_epoch(make, pg_url: str) -> None:  # type: ignore[no-untyped-def]
    store = Store.open(pg_url)
    try:
        base = store.bump_epoch() + 100
        store.set_setting(SETTING_EPOCH, base)  # e.g. a single controller ran before HA
        assert make("a").try_acquire_or_renew().epoch == base + 1
        assert store.bump_epoch() == base + 2
    finally:
        store.close()


@pytest.mark.postgres
async def test_run_elects_one_and_hands_over_on_stop(make) -> None:  # type: ignore[no-untyped-def]
    a, b = make("a"), make("b")
    ea, eb = Events(), Events()
    ta = asyncio.create_task(a.run(ea.on_elected, ea.on_lost))
    assert await ea.next() == ("elected", a.leading_epoch)
    first = a.leading_epoch
    assert first is not None
    tb = asyncio.create_task(b.run(eb.on_elected, eb.on_lost))
    a.stop()
    await ta
    assert await ea.next() == ("lost", None) and a.leading_epoch is None
    assert await eb.next() == ("elected", first + 1)
    assert a.current().holder == "b"
    tb.cancel()
    with pytest.raises(asyncio.CancelledError):
        await tb
    assert await eb.next() == ("lost", None)
    assert not b.current().live  # released on the way out


@pytest.mark.postgres
async def test_killed_connection_steps_down_before_expiry_then_reelects(  # type: ignore[no-untyped-def]
        make, admin) -> None:
    a = make(f"k-{uuid.uuid4().hex[:8]}", ttl_s=2.0, renew_every_s=0.2, step_down_margin_s=0.5)
    events = Events(lambda: db_expires_in_s(admin, a.name))
    task = asyncio.create_task(a.run(events.on_elected, events.on_lost))
    kind, first = await events.next()
    assert kind == "elected"
    killed = admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                           "WHERE application_name = %s",
                           (f"gearshift-leader:{a.controller_id}",)).fetchall()
    assert killed == [(True,)]
    assert await events.next() == ("lost", None)
    assert events.probed[0] > 0  # the database lease was still valid when we stepped down
    assert "renewal failed" in (a.last_loss_reason or "")
    assert await events.next() == ("elected", first + 1)  # reconnected: a new term
    a.stop()
    await task


@pytest.mark.postgres
async def test_hung_database_steps_down_by_the_local_clock_before_expiry(  # type: ignore[no-untyped-def]
        make, admin, locker) -> None:
    clock = FakeClock()
    a = make(f"h-{uuid.uuid4().hex[:8]}", ttl_s=30.0, renew_every_s=10.0, step_down_margin_s=5.0,
             poll_s=0.02, clock=clock)
    events = Events(lambda: db_expires_in_s(admin, a.name))
    task = asyncio.create_task(a.run(events.on_elected, events.on_lost))
    assert (await events.next())[0] == "elected"
    with locker.transaction():  # the row is locked: the next renewal hangs
        locker.execute("SELECT 1 FROM leader_lease WHERE name = %s FOR UPDATE", (a.name,))
        clock.now += 12.0  # time for the next renewal
        while not admin.execute("SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                                " AND application_name = %s",
                                (f"gearshift-leader:{a.controller_id}",)).fetchall():
            await asyncio.sleep(0.01)
        assert events.queue.empty()  # hung, but still inside its local deadline
        clock.now += 14.0  # past ttl - margin = 25 s since the last successful renewal
        assert await events.next() == ("lost", None)
        assert events.probed[0] > 0  # stepped down while the database lease was valid
        assert "no successful renewal for 25 s" in (a.last_loss_reason or "")
    a.stop()
    await task


@pytest.mark.postgres
async def test_blocked_renewal_times_out_and_steps_down_before_expiry(  # type: ignore[no-untyped-def]
        make, admin, locker) -> None:
    a = make("a", ttl_s=2.0, renew_every_s=0.3, step_down_margin_s=0.5)
    events = Events(lambda: db_expires_in_s(admin, a.name))
    task = asyncio.create_task(a.run(events.on_elected, events.on_lost))
    assert (await events.next())[0] == "elected"
    with locker.transaction():
        locker.execute("SELECT 1 FROM leader_lease WHERE name = %s FOR UPDATE", (a.name,))
        assert await events.next() == ("lost", None)
        assert events.probed[0] > 0
    a.stop()
    await task


def test_unreachable_database_is_unavailable_without_password() -> None:
    e = LeaderElector("postgresql+psycopg://postgres:s3cret@127.0.0.1:1/nodb", "a", "a:1")
    try:
        with pytest.raises(Unavailable) as err:
            e.try_acquire_or_renew()
        assert "127.0.0.1:1/nodb" in err.value.message and "s3cret" not in err.value.message
        with pytest.raises(Unavailable):
            e.current()
        assert e.step_down() is False
    finally:
        e.close()


async def test_run_against_unreachable_database_never_leads_and_stops() -> None:
    e = LeaderElector("postgresql+psycopg://postgres@127.0.0.1:1/nodb", "a", "a:1",
                      ttl_s=1.0, renew_every_s=0.1, step_down_margin_s=0.2)
    events = Events()
    task = asyncio.create_task(e.run(events.on_elected, events.on_lost))
    await asyncio.sleep(0.3)
    e.stop()
    await task
    e.close()
    assert events.queue.empty() and e.leading_epoch is None


@pytest.mark.parametrize("kwargs, needle", [
    ({"ttl_s": 0}, "ttl_s must be a positive number"),
    ({"renew_every_s": float("nan")}, "renew_every_s must be a positive number"),
    ({"ttl_s": 4.0, "renew_every_s": 3.0}, "renew_every_s (3) must be less than"),
    ({"statement_timeout_s": 9.0}, "statement_timeout_s (9) must be less than"),
    ({"name": ""}, "name must be a non-empty string"),
])
def test_bad_timings_are_config_errors(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        LeaderElector("postgresql+psycopg://postgres@127.0.0.1/db", "a", "a:1", **kwargs)
    assert needle in err.value.message


@pytest.mark.parametrize("url, needle", [
    ("mysql://u@h/db", "unsupported database URL scheme 'mysql'"),
    ("sqlite:///x.db", "needs PostgreSQL"),
])
def test_bad_urls_are_config_errors(url: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        LeaderElector(url, "a", "a:1")


async def test_sqlite_is_a_single_always_leading_controller(  # type: ignore[no-untyped-def]
        tmp_path: Path, caplog) -> None:
    url = default_sqlite_url(tmp_path / "data")
    store = Store.open(url)
    caplog.set_level(logging.INFO, logger="gearshift.controller.ha.leader")
    elector = LeaderElector.for_url(url, default_controller_id(), "127.0.0.1:7070", store=store)
    try:
        assert isinstance(elector, SingleControllerLeader)
        assert "HA with several controllers needs PostgreSQL" in caplog.text
        assert not elector.current().is_leader
        events = Events()
        task = asyncio.create_task(elector.run(events.on_elected, events.on_lost))
        assert await events.next() == ("elected", 1)
        assert elector.current().is_leader and store.get_setting(SETTING_EPOCH) == 1
        elector.stop()
        await task
        assert await events.next() == ("lost", None)
        assert elector.try_acquire_or_renew().epoch == 2  # a new term bumps the epoch
    finally:
        elector.close()
        store.close()
