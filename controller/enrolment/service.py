"""The controller's side of enrolment (docs/enrolment.md).

- `EnrolService` signs agents' certificate requests: `Enrol` (bootstrap token, on
  the enrolment listener) and `Renew` (current certificate, on the mutual-TLS port).
  Both check everything before they store anything (`EnrolmentStore` does each
  change in one transaction) and refuse with a status and a message naming the
  fault: malformed token or CSR, another host than the token allows, an expired,
  revoked or spent one-time token, a revoked host, a host already enrolled.
  `Enrol` admits requests by rate first (`EnrolAdmission`: per source address and
  overall), and logs its refusals as one summary line per `REFUSAL_LOG_INTERVAL_S`.
- `Revocations` is the set of hosts this controller refuses (revoked, or reset and
  not enrolled again): read from the shared store at start and every
  `REVOCATION_REFRESH_S`, and updated at once by a revocation or reset made here.
  The agent service refuses a Hello from a host in it; the controller closes the
  open streams of hosts in it.
- `EnrolmentRpcs` are the administration calls of `ControlService` (tokens, the
  hosts that asked to join, approval, revocation and reset); `ControlService` holds one
  and hands these calls to it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Callable
from typing import Any

from grpc import aio

from gearshift.common.errors import (
    FailedPrecondition,
    GearshiftError,
    InvalidArgument,
    PermissionDenied,
)
from gearshift.controller.api.security import peer_host_id
from gearshift.controller.enrolment.admission import (
    REFUSAL_LOG_INTERVAL_S,
    EnrolAdmission,
    RefusalKind,
    RefusalTally,
    peer_source,
    refusal_kind,
)
from gearshift.controller.enrolment.certificate_authority import SigningCa
from gearshift.controller.enrolment.rules import (
    Csr,
    EnrolmentState,
    Outcome,
    check_host_id,
    check_pattern,
    check_renewal,
    new_token,
    parse_csr,
    split_token,
)
from gearshift.controller.enrolment.store import (
    BootstrapTokenRow,
    EnrolmentStore,
    HostEnrolmentRow,
)
from gearshift.v1 import enrol_pb2, enrol_pb2_grpc

log = logging.getLogger(__name__)

REVOCATION_REFRESH_S = 2.0
PENDING_RETRY_S = 5.0
MIN_CERT_TTL_S = 2.0
MAX_TOKEN_TTL_S = 365 * 86400.0
DEFAULT_TOKEN_TTL_S = 86400.0


class Revocations:
    """Hosts this controller refuses, as last read from the store (plus its own revocations
    and resets): revoked hosts, and reset hosts until they enrol again."""

    def __init__(self, store: EnrolmentStore) -> None:
        self.store = store
        self.hosts: frozenset[str] = frozenset()
        self._reset: frozenset[str] = frozenset()  # of `hosts`, those reset (not revoked)

    def refresh(self) -> set[str]:
        """Read the store; returns the hosts newly refused since the last read."""
        found = self.store.refused_hosts()
        new = set(found) - self.hosts
        self.hosts = frozenset(found)
        self._reset = frozenset(h for h, state in found.items() if state == EnrolmentState.RESET)
        return new

    def add(self, host: str, state: EnrolmentState = EnrolmentState.REVOKED) -> None:
        self.hosts = self.hosts | {host}
        self._reset = self._reset | {host} if state == EnrolmentState.RESET \
            else self._reset - {host}

    def enrolled_again(self, host: str) -> None:
        """A reset host enrolled here: no longer refused (other controllers read it)."""
        if host in self._reset:
            self.hosts, self._reset = self.hosts - {host}, self._reset - {host}

    def refusal(self, host: str) -> str | None:
        if host in self._reset:
            return (f"host {host!r} was reset (`gearshift hosts reset`); its certificate is "
                    "refused until it enrols again with a bootstrap token")
        if host in self.hosts:
            return f"host {host!r} is revoked (`gearshift hosts revoke`); refused"
        return None


class EnrolService(enrol_pb2_grpc.EnrolServiceServicer):
    """Signs certificate requests with the controller's CA (see the module doc)."""

    def __init__(self, store: EnrolmentStore, ca: SigningCa | None, cert_ttl_s: float,
                 revocations: Revocations, outcomes: Any = None, *,
                 admission: EnrolAdmission | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 refusal_log_interval_s: float = REFUSAL_LOG_INTERVAL_S) -> None:
        self.store = store
        # a Counter labelled by outcome (issued, pending, renewed, refused, rate_limited)
        self.outcomes = outcomes
        self.ca = ca
        self.cert_ttl_s = cert_ttl_s
        self.revocations = revocations
        self.admission = admission if admission is not None else EnrolAdmission()
        self.clock = clock  # monotonic seconds, for the rate limits
        self.refusal_log_interval_s = refusal_log_interval_s
        self.refusals = RefusalTally()

    def _sign(self, csr: Csr) -> tuple[bytes, dt.datetime]:
        if self.ca is None:
            raise FailedPrecondition("this controller signs no certificates "
                                     "(started without --ca-key)")
        cert = self.ca.sign_host(csr.host, csr.public_key, self.cert_ttl_s)
        return SigningCa.pem(cert), cert.not_valid_after_utc

    def _count(self, outcome: str) -> None:
        if self.outcomes is not None:
            self.outcomes.labels(outcome).inc()

    async def Enrol(self, request: enrol_pb2.EnrolRequest,
                    context: aio.ServicerContext) -> enrol_pb2.EnrolResponse:
        source = peer_source(context.peer())
        try:
            self.admission.admit(source, self.clock())  # before any costly work
            resp = await self._enrol(request)
        except GearshiftError as exc:
            self._refused(exc, source)
            raise
        self._count("issued" if resp.status == enrol_pb2.ENROL_STATUS_ISSUED else "pending")
        return resp

    def _refused(self, exc: GearshiftError, source: str) -> None:
        """Counted at once; logged in the interval's summary line (`log_refusals`), not
        one line per request: anyone who reaches the listener can send them."""
        kind = refusal_kind(exc)
        self._count("rate_limited" if kind == RefusalKind.RATE_LIMITED else "refused")
        if self.refusals.add(kind, source, exc.message):
            asyncio.get_running_loop().call_later(self.refusal_log_interval_s,
                                                  self.log_refusals)

    def log_refusals(self) -> str | None:
        """Log (and return) the summary line of the refusals since the last one."""
        line = self.refusals.summary(self.refusal_log_interval_s)
        if line is not None:
            log.warning("%s", line)
        return line

    async def _enrol(self, request: enrol_pb2.EnrolRequest) -> enrol_pb2.EnrolResponse:
        token_id, secret = split_token(request.bootstrap_token)
        csr = parse_csr(request.csr_pem)
        if self.ca is None:
            self._sign(csr)  # refuses before anything is stored
        outcome, cert_pem, not_after, message = await asyncio.to_thread(
            self.store.enrol, token_id, secret, csr, request.csr_pem.decode("ascii"),
            self._sign)
        self.revocations.enrolled_again(csr.host)  # if it was reset: a first enrolment now
        resp = enrol_pb2.EnrolResponse(message=message)
        if outcome == Outcome.ISSUE:
            assert not_after is not None
            resp.status = enrol_pb2.ENROL_STATUS_ISSUED
            resp.certificate_pem = cert_pem
            resp.not_after.FromDatetime(not_after)
            log.info("enrolled host %s with token %s (key %s, until %s)", csr.host, token_id,
                     csr.key_fingerprint, not_after.isoformat(timespec="seconds"))
        else:
            resp.status = enrol_pb2.ENROL_STATUS_PENDING
            resp.retry_after_s = PENDING_RETRY_S
            log.warning("host %s asks to enrol with token %s (key %s): waits for "
                        "`gearshift hosts approve %s`", csr.host, token_id, csr.key_fingerprint,
                        csr.host)
        return resp

    async def Renew(self, request: enrol_pb2.RenewRequest,
                    context: aio.ServicerContext) -> enrol_pb2.EnrolResponse:
        try:
            resp = await self._renew(request, peer_host_id(context))
        except GearshiftError as exc:
            self._count("refused")
            log.warning("renewal refused (%s): %s", context.peer(), exc.message)
            raise
        self._count("renewed")
        return resp

    async def _renew(self, request: enrol_pb2.RenewRequest,
                     host: str | None) -> enrol_pb2.EnrolResponse:
        csr = parse_csr(request.csr_pem)
        current = await asyncio.to_thread(self.store.get, csr.host)
        check_renewal(host, csr, current.enrolled() if current is not None else None)
        refusal = self.revocations.refusal(csr.host)
        if refusal is not None:
            raise PermissionDenied(refusal)
        cert_pem, not_after = self._sign(csr)
        await asyncio.to_thread(self.store.renewed, csr.host, csr, not_after)
        log.info("renewed the certificate of host %s (key %s, until %s)", csr.host,
                 csr.key_fingerprint, not_after.isoformat(timespec="seconds"))
        resp = enrol_pb2.EnrolResponse(status=enrol_pb2.ENROL_STATUS_ISSUED,
                                       certificate_pem=cert_pem, message="renewed")
        resp.not_after.FromDatetime(not_after)
        return resp


def token_proto(row: BootstrapTokenRow) -> enrol_pb2.BootstrapToken:
    out = enrol_pb2.BootstrapToken(token_id=row.token_id, host_pattern=row.host_pattern,
                                   one_time=row.one_time, auto_approve=row.auto_approve,
                                   description=row.description, uses=row.uses,
                                   revoked=row.revoked is not None, used_by=row.used_by or "")
    out.expires.FromDatetime(row.expires)
    out.created.FromDatetime(row.created)
    return out


_STATES = {EnrolmentState.PENDING: enrol_pb2.ENROLMENT_STATE_PENDING,
           EnrolmentState.APPROVED: enrol_pb2.ENROLMENT_STATE_APPROVED,
           EnrolmentState.REVOKED: enrol_pb2.ENROLMENT_STATE_REVOKED,
           EnrolmentState.RESET: enrol_pb2.ENROLMENT_STATE_RESET}


def enrolment_proto(row: HostEnrolmentRow) -> enrol_pb2.HostEnrolment:
    out = enrol_pb2.HostEnrolment(host_id=row.host_id, state=_STATES[row.state],
                                  token_id=row.token_id or "",
                                  key_fingerprint=row.key_fingerprint, note=row.note)
    out.requested.FromDatetime(row.requested)
    out.changed.FromDatetime(row.changed)
    if row.cert_not_after is not None:
        out.cert_not_after.FromDatetime(row.cert_not_after)
    return out


class EnrolmentRpcs:
    """ControlService's enrolment administration, which it holds and hands these calls to:
    given the enrolment store, the revocations and `on_host_revoked` (closes the host's
    stream here) at construction."""

    def __init__(self, enrolment_store: EnrolmentStore | None, revocations: Revocations | None,
                 on_host_revoked: Callable[[str, str], None] | None) -> None:
        self.enrolment_store = enrolment_store
        self.revocations = revocations
        self.on_host_revoked = on_host_revoked

    def _enrolments(self) -> EnrolmentStore:
        if self.enrolment_store is None:
            raise FailedPrecondition("enrolment is not available on this controller")
        return self.enrolment_store

    async def CreateBootstrapToken(self, request: enrol_pb2.CreateBootstrapTokenRequest,
                                   context: aio.ServicerContext,
                                   ) -> enrol_pb2.CreateBootstrapTokenResponse:
        pattern = check_pattern(request.host_pattern)
        ttl_s = request.ttl_s or DEFAULT_TOKEN_TTL_S
        if not (60.0 <= ttl_s <= MAX_TOKEN_TTL_S) and request.ttl_s:
            raise InvalidArgument(f"--ttl: expected 60 s to 365 days, found {ttl_s:g} s")
        if len(request.description) > 200:
            raise InvalidArgument("--description: at most 200 characters")
        made = new_token()
        row = await asyncio.to_thread(
            self._enrolments().add_token, made, host_pattern=pattern, ttl_s=ttl_s,
            one_time=request.one_time, auto_approve=request.auto_approve,
            description=request.description)
        log.info("bootstrap token %s created for hosts %r (%s, %s, until %s)", row.token_id,
                 pattern, "one-time" if row.one_time else "reusable",
                 "auto-approve" if row.auto_approve else "approval needed",
                 row.expires.isoformat(timespec="seconds"))
        return enrol_pb2.CreateBootstrapTokenResponse(token=token_proto(row),
                                                      secret_token=made.secret_token)

    async def ListBootstrapTokens(self, request: enrol_pb2.ListBootstrapTokensRequest,
                                  context: aio.ServicerContext,
                                  ) -> enrol_pb2.ListBootstrapTokensResponse:
        rows = await asyncio.to_thread(self._enrolments().list_tokens)
        return enrol_pb2.ListBootstrapTokensResponse(tokens=[token_proto(r) for r in rows])

    async def RevokeBootstrapToken(self, request: enrol_pb2.RevokeBootstrapTokenRequest,
                                   context: aio.ServicerContext) -> enrol_pb2.BootstrapToken:
        row = await asyncio.to_thread(self._enrolments().revoke_token, request.token_id)
        log.warning("bootstrap token %s revoked", row.token_id)
        return token_proto(row)

    async def ListEnrolments(self, request: enrol_pb2.ListEnrolmentsRequest,
                             context: aio.ServicerContext) -> enrol_pb2.ListEnrolmentsResponse:
        rows = await asyncio.to_thread(self._enrolments().list, request.pending_only)
        return enrol_pb2.ListEnrolmentsResponse(hosts=[enrolment_proto(r) for r in rows])

    async def ApproveHost(self, request: enrol_pb2.HostActionRequest,
                          context: aio.ServicerContext) -> enrol_pb2.HostEnrolment:
        host = check_host_id(request.host_id, "HOST")
        row = await asyncio.to_thread(self._enrolments().approve, host, request.reason)
        log.warning("host %s approved", host)
        return enrolment_proto(row)

    async def RevokeHost(self, request: enrol_pb2.HostActionRequest,
                         context: aio.ServicerContext) -> enrol_pb2.HostEnrolment:
        host = check_host_id(request.host_id, "HOST")
        row = await asyncio.to_thread(self._enrolments().revoke, host, request.reason)
        if self.revocations is not None:
            self.revocations.add(host)
        if self.on_host_revoked is not None:
            self.on_host_revoked(host, row.note)
        log.warning("host %s revoked%s", host, f": {request.reason}" if request.reason else "")
        return enrolment_proto(row)

    async def ResetHost(self, request: enrol_pb2.HostActionRequest,
                        context: aio.ServicerContext) -> enrol_pb2.HostEnrolment:
        """Clear a host's enrolment (it lost its key): its old certificate is refused, and
        its stream here closed, until it enrols again with a valid bootstrap token."""
        host = check_host_id(request.host_id, "HOST")
        row = await asyncio.to_thread(self._enrolments().reset, host, request.reason)
        if self.revocations is not None:
            self.revocations.add(host, EnrolmentState.RESET)
        if self.on_host_revoked is not None:
            self.on_host_revoked(host, row.note)
        log.warning("host %s reset%s: it may enrol again with a bootstrap token", host,
                    f" ({request.reason})" if request.reason else "")
        return enrolment_proto(row)


__all__ = ["DEFAULT_TOKEN_TTL_S", "MIN_CERT_TTL_S", "PENDING_RETRY_S", "REVOCATION_REFRESH_S",
           "EnrolService", "EnrolmentRpcs", "Revocations", "enrolment_proto", "token_proto"]
