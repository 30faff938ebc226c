"""Durable enrolment state (docs/enrolment.md): bootstrap tokens and host enrolments.

`BootstrapTokenRow` keeps a token's id, the SHA-256 of its secret (never the
secret), what it allows and its use (a one-time token is spent once a certificate
is issued with it). `HostEnrolmentRow` keeps one row per host that asked to join,
or that was revoked or reset: its state, the token it used, the fingerprint of the
key it asked for, the request itself while it waits, and the expiry of the last
certificate issued to it for this enrolment (none: not issued yet). The tables are
created by the Alembic revisions ``0005`` and ``0007`` (keep them in step; a test
compares them).

`EnrolmentStore` does each change in one transaction, checking inside it what the
change depends on (a token's use by a one-time request, a host's state), so a
refused request stores nothing, two controllers on one PostgreSQL database
cannot both consume one one-time token, and a request for an enrolled host changes
nothing of it.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Field, Session, SQLModel, col, select

from gearshift.common.errors import FailedPrecondition, NotFound, PermissionDenied
from gearshift.controller.enrolment.rules import (
    BadToken,
    Csr,
    Enrolled,
    EnrolmentState,
    NewToken,
    Outcome,
    TokenGrant,
    check_reset,
    decide,
    secret_matches,
)
from gearshift.controller.store.tables import UTCDateTime, utcnow

ENROLMENT_STATE_LENGTH = 16


def _enum(cls: type[Any], length: int) -> Any:
    return sa.Enum(cls, native_enum=False, length=length, create_constraint=False,
                   values_callable=lambda e: [m.value for m in e], validate_strings=True)


class BootstrapTokenRow(SQLModel, table=True):
    """A bootstrap token: what it allows, and its use (the secret only as a hash)."""

    __tablename__ = "bootstrap_tokens"

    token_id: str = Field(primary_key=True, max_length=16)
    secret_hash: str = Field(max_length=64)
    host_pattern: str
    expires: dt.datetime = Field(sa_type=UTCDateTime, nullable=False)
    one_time: bool = False
    auto_approve: bool = False
    description: str = ""
    created: dt.datetime = Field(default_factory=utcnow, sa_type=UTCDateTime, nullable=False)
    uses: int = 0
    used_by: str | None = None  # one-time tokens: the host that used it
    revoked: dt.datetime | None = Field(default=None, sa_type=UTCDateTime, nullable=True)
    # one-time tokens: when a certificate was issued with it (refused from then on)
    spent: dt.datetime | None = Field(default=None, sa_type=UTCDateTime, nullable=True)

    def grant(self) -> TokenGrant:
        return TokenGrant(self.token_id, self.host_pattern, self.expires, self.one_time,
                          self.auto_approve, self.revoked is not None, self.used_by,
                          self.spent)


class HostEnrolmentRow(SQLModel, table=True):
    """One host's enrolment: pending, approved, revoked or reset."""

    __tablename__ = "host_enrolments"

    host_id: str = Field(primary_key=True)
    state: EnrolmentState = Field(sa_type=_enum(EnrolmentState, ENROLMENT_STATE_LENGTH),
                                  nullable=False)
    token_id: str | None = None  # the token of the last request (None: revoked unenrolled)
    key_fingerprint: str = ""
    csr_pem: str | None = Field(default=None, sa_type=sa.Text)  # while pending
    requested: dt.datetime = Field(default_factory=utcnow, sa_type=UTCDateTime, nullable=False)
    changed: dt.datetime = Field(default_factory=utcnow, sa_type=UTCDateTime, nullable=False)
    # the last certificate issued (or renewed) for this enrolment; None: none yet
    cert_not_after: dt.datetime | None = Field(default=None, sa_type=UTCDateTime,
                                               nullable=True)
    note: str = ""

    def enrolled(self) -> Enrolled:
        return Enrolled(self.state, self.key_fingerprint, self.cert_not_after is not None)


# Signs the request's key for a host and returns (certificate PEM, not_after).
Signer = Callable[[Csr], tuple[bytes, dt.datetime]]


class EnrolmentStore:
    """Enrolment queries and changes over the controller's store engine."""

    def __init__(self, engine: Engine, clock: Callable[[], dt.datetime] = utcnow) -> None:
        self.engine = engine
        self.clock = clock
        # SQLite has no row locks: requests of one controller (threads) take turns, so a
        # one-time token cannot go to two hosts; PostgreSQL locks the token row as well.
        self._enrol_lock = threading.Lock()

    # -- tokens ------------------------------------------------------------------

    def add_token(self, made: NewToken, *, host_pattern: str, ttl_s: float, one_time: bool,
                  auto_approve: bool, description: str) -> BootstrapTokenRow:
        now = self.clock()
        row = BootstrapTokenRow(token_id=made.token_id, secret_hash=made.secret_hash,
                                host_pattern=host_pattern,
                                expires=now + dt.timedelta(seconds=ttl_s), one_time=one_time,
                                auto_approve=auto_approve, description=description, created=now)
        with Session(self.engine, expire_on_commit=False) as s:
            s.add(row)
            s.commit()
        return row

    def list_tokens(self) -> list[BootstrapTokenRow]:
        with Session(self.engine, expire_on_commit=False) as s:
            return list(s.exec(select(BootstrapTokenRow)
                               .order_by(col(BootstrapTokenRow.created))).all())

    def revoke_token(self, token_id: str) -> BootstrapTokenRow:
        with Session(self.engine, expire_on_commit=False) as s:
            row = s.get(BootstrapTokenRow, token_id)
            if row is None:
                raise NotFound(f"no bootstrap token {token_id!r} (see `gearshift tokens list`)")
            if row.revoked is None:
                row.revoked = self.clock()
                s.add(row)
                s.commit()
            return row

    # -- enrolment ---------------------------------------------------------------

    def enrol(self, token_id: str, secret: str, csr: Csr, csr_pem: str,
              sign: Signer) -> tuple[Outcome, bytes, dt.datetime | None, str]:
        """Check and record one enrolment request in one transaction.

        Returns (outcome, certificate PEM or b"", its not_after, message). Raises,
        storing nothing, when the token or the host refuses it.
        """
        now = self.clock()
        with self._enrol_lock, Session(self.engine, expire_on_commit=False) as s:
            token = s.exec(select(BootstrapTokenRow)
                           .where(col(BootstrapTokenRow.token_id) == token_id)
                           .with_for_update()).first()
            if token is None or not secret_matches(secret, token.secret_hash):
                raise BadToken(f"bootstrap token {token_id} is unknown or its secret is wrong")
            current = s.exec(select(HostEnrolmentRow)
                             .where(col(HostEnrolmentRow.host_id) == csr.host)
                             .with_for_update()).first()
            outcome = decide(token.grant(), csr,
                             current.enrolled() if current is not None else None, now)
            if token.one_time and token.used_by is None:
                token.used_by = csr.host
            token.uses += 1
            row = current or HostEnrolmentRow(host_id=csr.host, state=EnrolmentState.PENDING,
                                              requested=now)
            if current is None or row.key_fingerprint != csr.key_fingerprint \
                    or row.state == EnrolmentState.RESET:
                row.requested = now
            row.token_id, row.key_fingerprint, row.changed = token_id, csr.key_fingerprint, now
            if outcome == Outcome.ISSUE:
                cert_pem, not_after = sign(csr)
                if token.one_time:
                    token.spent = now
                s.add(token)
                row.state, row.csr_pem, row.cert_not_after = EnrolmentState.APPROVED, None, \
                    not_after
                row.note = "auto-approved" if token.auto_approve else row.note
                s.add(row)
                s.commit()
                return outcome, cert_pem, not_after, f"certificate issued to {csr.host}"
            s.add(token)
            row.state, row.csr_pem, row.cert_not_after = EnrolmentState.PENDING, csr_pem, None
            s.add(row)
            s.commit()
            return (outcome, b"", None,
                    f"host {csr.host} waits for approval: `gearshift hosts approve {csr.host}`")

    def renewed(self, host: str, csr: Csr, not_after: dt.datetime) -> None:
        """Record a renewal's new key and expiry (the host row is made for pre-made hosts)."""
        now = self.clock()
        with Session(self.engine, expire_on_commit=False) as s:
            row = s.get(HostEnrolmentRow, host) or HostEnrolmentRow(
                host_id=host, state=EnrolmentState.APPROVED, requested=now, note="renewed")
            if row.state in (EnrolmentState.REVOKED, EnrolmentState.RESET):
                raise PermissionDenied(f"host {host!r} is {row.state.value}; renewal refused")
            row.key_fingerprint, row.cert_not_after, row.changed = \
                csr.key_fingerprint, not_after, now
            s.add(row)
            s.commit()

    def get(self, host: str) -> HostEnrolmentRow | None:
        with Session(self.engine, expire_on_commit=False) as s:
            return s.get(HostEnrolmentRow, host)

    def list(self, pending_only: bool = False) -> list[HostEnrolmentRow]:
        with Session(self.engine, expire_on_commit=False) as s:
            q = select(HostEnrolmentRow).order_by(col(HostEnrolmentRow.host_id))
            if pending_only:
                q = q.where(col(HostEnrolmentRow.state) == EnrolmentState.PENDING)
            return list(s.exec(q).all())

    def approve(self, host: str, reason: str = "") -> HostEnrolmentRow:
        with Session(self.engine, expire_on_commit=False) as s:
            row = s.get(HostEnrolmentRow, host)
            if row is None:
                raise NotFound(f"host {host!r} has not asked to enrol "
                               "(see `gearshift hosts list --pending`)")
            if row.state == EnrolmentState.REVOKED:
                raise FailedPrecondition(f"host {host!r} is revoked; a revoked host id "
                                         "cannot be approved again")
            if row.state == EnrolmentState.RESET:
                raise FailedPrecondition(f"host {host!r} was reset and has not asked to enrol "
                                         "again yet (see `gearshift hosts list --pending`)")
            if row.state == EnrolmentState.PENDING:
                row.state, row.changed = EnrolmentState.APPROVED, self.clock()
                row.note = f"approved{': ' + reason if reason else ''}"
                s.add(row)
                s.commit()
            return row

    def revoke(self, host: str, reason: str = "") -> HostEnrolmentRow:
        """Revoke `host` (enrolled or holding a pre-made certificate): idempotent."""
        now = self.clock()
        with Session(self.engine, expire_on_commit=False) as s:
            row = s.get(HostEnrolmentRow, host)
            if row is None:  # a host with a pre-made certificate, or none yet
                row = HostEnrolmentRow(host_id=host, state=EnrolmentState.PENDING, requested=now)
            if row.state != EnrolmentState.REVOKED:
                row.state, row.changed, row.csr_pem = EnrolmentState.REVOKED, now, None
                row.note = f"revoked{': ' + reason if reason else ''}"
                s.add(row)
                s.commit()
            return row

    def reset(self, host: str, reason: str = "") -> HostEnrolmentRow:
        """Clear `host`'s enrolment (`gearshift hosts reset`): its key and certificate no
        longer count, its next request with a valid token is a first enrolment, and
        until then it is refused like a revoked host. Idempotent; a revoked host stays so."""
        now = self.clock()
        with self._enrol_lock, Session(self.engine, expire_on_commit=False) as s:
            row = s.exec(select(HostEnrolmentRow)
                         .where(col(HostEnrolmentRow.host_id) == host)
                         .with_for_update()).first()
            check_reset(host, row.enrolled() if row is not None else None)
            assert row is not None
            if row.state != EnrolmentState.RESET:
                row.state, row.changed = EnrolmentState.RESET, now
                row.key_fingerprint, row.csr_pem, row.cert_not_after = "", None, None
                row.note = f"reset{': ' + reason if reason else ''}"
                s.add(row)
                s.commit()
            return row

    def revoked_hosts(self) -> set[str]:
        with Session(self.engine) as s:
            return set(s.exec(select(HostEnrolmentRow.host_id).where(
                col(HostEnrolmentRow.state) == EnrolmentState.REVOKED)).all())

    def refused_hosts(self) -> dict[str, EnrolmentState]:
        """Hosts refused whatever certificate they present: revoked, or reset and not
        enrolled again yet."""
        refused = (EnrolmentState.REVOKED, EnrolmentState.RESET)
        with Session(self.engine) as s:
            rows = s.exec(select(HostEnrolmentRow.host_id, HostEnrolmentRow.state).where(
                col(HostEnrolmentRow.state).in_(refused))).all()
            return {host: EnrolmentState(state) for host, state in rows}


__all__ = ["BootstrapTokenRow", "EnrolmentStore", "HostEnrolmentRow", "Signer"]
