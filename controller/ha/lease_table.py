"""The leader lease table (``leader_lease``) and the SQL that `LeaderElector` runs on it.

One row per lease name; a NULL holder means never held. Every statement takes its
times from the database clock (``now()``), never from Python, so controllers need
no synchronised clocks. The schema is created by migration 0003. `read_lease` and
`store_epoch` read inside the caller's transaction.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlmodel import Field, SQLModel

from gearshift.controller.ha.elector import LeaseState
from gearshift.controller.store.tables import SETTING_EPOCH, UTCDateTime

# Election messages keep the one logger name that operators filter on.
log = logging.getLogger("gearshift.controller.ha.leader")


class LeaderLeaseRow(SQLModel, table=True):
    """One lease per name; NULL holder = never held. Times are set by the database."""

    __tablename__ = "leader_lease"

    name: str = Field(primary_key=True)
    holder: str | None = Field(default=None, nullable=True)  # controller id
    address: str | None = Field(default=None, nullable=True)  # where the holder serves gRPC
    epoch: int = Field(default=0, sa_type=sa.BigInteger, nullable=False)  # fencing epoch
    acquired_at: datetime | None = Field(default=None, sa_type=UTCDateTime, nullable=True)
    renewed_at: datetime | None = Field(default=None, sa_type=UTCDateTime, nullable=True)
    expires_at: datetime | None = Field(default=None, sa_type=UTCDateTime, nullable=True)


# One `try_acquire_or_renew()` transaction: ENSURE, LOCK, then RENEW, or TAKE with
# STORE_EPOCH / SAVE_EPOCH (the store's epoch is kept in step with the lease's).
ENSURE = sa.text("INSERT INTO leader_lease (name, epoch) VALUES (:name, 0) "
                 "ON CONFLICT (name) DO NOTHING")
LOCK = sa.text("SELECT holder, epoch, coalesce(expires_at > now(), false) AS live "
               "FROM leader_lease WHERE name = :name FOR UPDATE")
RENEW = sa.text("UPDATE leader_lease SET renewed_at = now(), "
                "expires_at = now() + make_interval(secs => :ttl) WHERE name = :name")
TAKE = sa.text("UPDATE leader_lease SET holder = :me, address = :address, epoch = :epoch, "
               "acquired_at = now(), renewed_at = now(), "
               "expires_at = now() + make_interval(secs => :ttl) WHERE name = :name")
STORE_EPOCH = sa.text("SELECT value FROM settings WHERE key = :key FOR UPDATE")
SAVE_EPOCH = sa.text("INSERT INTO settings (key, value, updated) "
                     "VALUES (:key, to_json(CAST(:epoch AS bigint)), now()) "
                     "ON CONFLICT (key) DO UPDATE SET value = excluded.value, "
                     "updated = excluded.updated")
READ = sa.text("SELECT holder, address, epoch, "
               "extract(epoch FROM now() - renewed_at) AS age_s, "
               "extract(epoch FROM expires_at - now()) AS left_s, "
               "extract(epoch FROM now() - acquired_at) AS held_s "
               "FROM leader_lease WHERE name = :name")
RELEASE = sa.text("UPDATE leader_lease SET expires_at = now() WHERE name = :name "
                  "AND holder = :me AND epoch = :epoch AND expires_at > now()")


def _seconds(value: Any) -> float | None:
    return None if value is None else float(value)


def read_lease(conn: Connection, name: str, won: bool) -> LeaseState:
    """The lease `name` as it stands; `won`: this elector holds it for its current term."""
    row = conn.execute(READ, {"name": name}).first()
    if row is None:
        return LeaseState(False, None, None, 0, None, None)
    return LeaseState(is_leader=won, holder=row.holder, address=row.address,
                      epoch=int(row.epoch), lease_age_s=_seconds(row.age_s),
                      expires_in_s=_seconds(row.left_s), leader_for_s=_seconds(row.held_s))


def store_epoch(conn: Connection) -> int:
    """The store's ``settings.epoch``, locked until the transaction ends (0 when unset)."""
    value = conn.execute(STORE_EPOCH, {"key": SETTING_EPOCH}).scalar()
    if isinstance(value, bool) or not isinstance(value, int):
        if value is not None:
            log.warning("settings %r holds %r, not an integer; ignoring it", SETTING_EPOCH,
                        value)
        return 0
    return value
