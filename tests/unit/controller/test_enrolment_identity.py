"""Enrolment never hands an enrolled host's id to a new key; a one-time token is spent at
its first certificate; `hosts reset` lets a host that lost its key enrol again; Enrol is
rate limited before any costly work and its refusals are summed up in one log line.

The rules are pure; the store runs on SQLite and PostgreSQL (the `store` fixture); the
service on a real SQLite store, called as gRPC calls it (with a peer address)."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from prometheus_client import CollectorRegistry

from gearshift.agents.enrolment import make_csr
from gearshift.common.errors import (
    FailedPrecondition,
    GearshiftError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from gearshift.controller.enrolment.admission import EnrolAdmission, peer_source
from gearshift.controller.enrolment.certificate_authority import SigningCa, init_certs
from gearshift.controller.enrolment.rules import (
    Csr,
    EnrolmentState,
    Outcome,
    TokenGrant,
    check_renewal,
    check_token,
    new_token,
    parse_csr,
    split_token,
)
from gearshift.controller.enrolment.service import EnrolService, Revocations
from gearshift.controller.enrolment.store import EnrolmentStore
from gearshift.controller.metrics import ControllerMetrics
from gearshift.controller.store.database import Store, default_sqlite_url
from gearshift.v1 import enrol_pb2

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)


def _csr(host: str = "gpu-1") -> tuple[Csr, bytes]:
    pem = make_csr(host, ec.generate_private_key(ec.SECP256R1()))
    return parse_csr(pem), pem


class Signer:
    """Counts what it signs (the real CA is not needed to decide)."""

    def __init__(self) -> None:
        self.signed: list[str] = []

    def __call__(self, csr: Csr) -> tuple[bytes, dt.datetime]:
        self.signed.append(csr.key_fingerprint)
        return b"-----BEGIN CERTIFICATE-----\n", NOW + dt.timedelta(hours=1)


def _token(es: EnrolmentStore, **overrides: Any) -> tuple[str, str]:
    made = new_token()
    fields: dict[str, Any] = {"host_pattern": "gpu-*", "ttl_s": 3600, "one_time": False,
                              "auto_approve": True, "description": ""}
    fields.update(overrides)
    es.add_token(made, **fields)
    return split_token(made.secret_token)


def _enrol(es: EnrolmentStore, token: tuple[str, str], csr: tuple[Csr, bytes],
           sign: Signer | None = None) -> Outcome:
    return es.enrol(token[0], token[1], csr[0], csr[1].decode(), sign or Signer())[0]


def _row(es: EnrolmentStore, host: str = "gpu-1") -> dict[str, Any]:
    row = es.get(host)
    assert row is not None
    return row.model_dump()


# -- finding 1: a manual-approval request for an approved host ------------------------

def test_a_manual_request_for_an_enrolled_host_is_refused_and_changes_nothing(
        store: Store) -> None:
    es = EnrolmentStore(store.engine, clock=lambda: NOW)
    auto, manual = _token(es), _token(es, auto_approve=False)
    real = _csr()
    assert _enrol(es, auto, real) == Outcome.ISSUE
    before, uses = _row(es), [t.uses for t in es.list_tokens()]

    with pytest.raises(FailedPrecondition, match=r"host 'gpu-1' is already enrolled .*"
                       r"`gearshift hosts reset gpu-1`"):
        _enrol(es, manual, _csr())
    assert _row(es) == before and es.list(pending_only=True) == []
    assert [t.uses for t in es.list_tokens()] == uses  # not even the token's use
    # The real host renews as before.
    renewal = _csr()
    check_renewal("gpu-1", renewal[0], es.get("gpu-1").enrolled())  # type: ignore[union-attr]
    es.renewed("gpu-1", renewal[0], NOW + dt.timedelta(hours=2))


def test_an_approval_waiting_for_its_host_is_not_taken_by_another_key(store: Store) -> None:
    es = EnrolmentStore(store.engine, clock=lambda: NOW)
    manual = _token(es, auto_approve=False)
    real = _csr()
    assert _enrol(es, manual, real) == Outcome.PENDING
    es.approve("gpu-1")
    approved = _row(es)
    sign = Signer()
    with pytest.raises(FailedPrecondition, match="approved for another key"):
        _enrol(es, manual, _csr(), sign)
    with pytest.raises(FailedPrecondition, match="approved for another key"):
        _enrol(es, _token(es), _csr(), sign)  # an auto-approving token changes nothing
    assert _row(es) == approved and sign.signed == []
    assert _enrol(es, manual, real, sign) == Outcome.ISSUE  # the approved key gets it
    assert sign.signed == [real[0].key_fingerprint]


# -- finding 2: a reusable auto-approving token and an enrolled host -----------------

def test_a_reusable_auto_approve_token_never_reissues_an_enrolled_host(store: Store) -> None:
    es = EnrolmentStore(store.engine, clock=lambda: NOW)
    token, sign = _token(es), Signer()
    real = _csr()
    assert _enrol(es, token, real, sign) == Outcome.ISSUE
    before = _row(es)
    for again in (_csr(), real):  # another key, and even the same one
        with pytest.raises(FailedPrecondition, match="already enrolled"):
            _enrol(es, token, again, sign)
    assert sign.signed == [real[0].key_fingerprint] and _row(es) == before
    assert _enrol(es, token, _csr("gpu-2"), sign) == Outcome.ISSUE  # other hosts still join


def test_a_one_time_token_is_spent_at_its_first_certificate(store: Store) -> None:
    es = EnrolmentStore(store.engine, clock=lambda: NOW)
    once = _token(es, one_time=True)
    assert _enrol(es, once, _csr()) == Outcome.ISSUE
    with pytest.raises(PermissionDenied, match="one-time and was spent: a certificate was "
                       "issued with it to host 'gpu-1'"):
        _enrol(es, once, _csr())
    assert es.list_tokens()[0].spent == NOW
    es.reset("gpu-1")  # even for a first enrolment after a reset
    with pytest.raises(PermissionDenied, match="was spent"):
        _enrol(es, once, _csr())
    # A manual one-time token: its host may ask again while pending, not once issued.
    manual = _token(es, one_time=True, auto_approve=False, host_pattern="gpu-2")
    key = _csr("gpu-2")
    assert _enrol(es, manual, key) == Outcome.PENDING
    assert _enrol(es, manual, key) == Outcome.PENDING
    es.approve("gpu-2")
    assert _enrol(es, manual, key) == Outcome.ISSUE
    with pytest.raises(PermissionDenied, match="was spent"):
        _enrol(es, manual, key)


def test_check_token_refuses_a_spent_one_time_token_for_its_own_host() -> None:
    grant = TokenGrant("0a1b2c3d", "gpu-*", NOW + dt.timedelta(hours=1), one_time=True,
                       auto_approve=True, used_by="gpu-1", spent=NOW)
    with pytest.raises(PermissionDenied, match="bootstrap token 0a1b2c3d is one-time and "
                       "was spent"):
        check_token(grant, "gpu-1", NOW)


# -- hosts reset ---------------------------------------------------------------------

def test_reset_lets_a_host_that_lost_its_key_enrol_again(store: Store) -> None:
    es = EnrolmentStore(store.engine, clock=lambda: NOW)
    auto, manual = _token(es), _token(es, auto_approve=False)
    old = _csr()
    _enrol(es, auto, old)
    row = es.reset("gpu-1", "disk replaced")
    assert (row.state, row.key_fingerprint, row.cert_not_after, row.note) == (
        EnrolmentState.RESET, "", None, "reset: disk replaced")
    assert es.reset("gpu-1").note == "reset: disk replaced"  # idempotent
    assert es.refused_hosts() == {"gpu-1": EnrolmentState.RESET}
    assert es.revoked_hosts() == set()
    # Until it enrols again, its old certificate renews nothing, and nothing is approved.
    with pytest.raises(PermissionDenied, match="was reset"):
        check_renewal("gpu-1", old[0], es.get("gpu-1").enrolled())  # type: ignore[union-attr]
    with pytest.raises(PermissionDenied, match="is reset; renewal refused"):
        es.renewed("gpu-1", old[0], NOW)
    with pytest.raises(FailedPrecondition, match="has not asked to enrol again"):
        es.approve("gpu-1")
    # Its next request with a valid token is a first enrolment: pending, approved, issued.
    new = _csr()
    assert _enrol(es, manual, new) == Outcome.PENDING
    assert es.refused_hosts() == {}
    es.approve("gpu-1")
    assert _enrol(es, manual, new) == Outcome.ISSUE
    assert _row(es)["key_fingerprint"] == new[0].key_fingerprint
    with pytest.raises(FailedPrecondition, match="already enrolled"):
        _enrol(es, auto, _csr())
    # A revoked host stays revoked; an unknown one has nothing to reset.
    es.revoke("gpu-1")
    with pytest.raises(FailedPrecondition, match="revoked host id stays revoked"):
        es.reset("gpu-1")
    with pytest.raises(NotFound, match="no enrolment to reset"):
        es.reset("gpu-9")
    assert es.refused_hosts() == {"gpu-1": EnrolmentState.REVOKED}


def test_revocations_refuse_a_reset_host_until_it_enrols_again(tmp_path: Any) -> None:
    store = Store.open(default_sqlite_url(tmp_path))
    try:
        es = EnrolmentStore(store.engine, clock=lambda: NOW)
        _enrol(es, _token(es), _csr())
        revocations = Revocations(es)
        es.reset("gpu-1")
        assert revocations.refresh() == {"gpu-1"}
        assert "was reset (`gearshift hosts reset`)" in (revocations.refusal("gpu-1") or "")
        revocations.enrolled_again("gpu-1")
        assert revocations.refusal("gpu-1") is None
        es.revoke("gpu-2")
        revocations.refresh()
        revocations.enrolled_again("gpu-2")  # a revoked host is never let back this way
        assert "is revoked" in (revocations.refusal("gpu-2") or "")
    finally:
        store.close()


# -- rate limits -----------------------------------------------------------------------

def test_admission_per_source_then_overall_token_buckets() -> None:
    gate = EnrolAdmission(per_source_per_s=5, per_source_burst=20, total_per_s=50,
                          total_burst=100)
    t = 1000.0
    for _ in range(20):
        gate.admit("10.0.0.1", t)
    with pytest.raises(ResourceExhausted, match=r"from 10.0.0.1 \(at most 5/s, bursts of 20\)"):
        gate.admit("10.0.0.1", t)
    gate.admit("10.0.0.2", t)  # another source has its own bucket
    for _ in range(5):  # refilled at 5/s
        gate.admit("10.0.0.1", t + 1.0)
    with pytest.raises(ResourceExhausted):
        gate.admit("10.0.0.1", t + 1.0)
    # Overall: bursts of 100 from many sources, then 50/s; a source's own refusal
    # takes nothing from everyone's share.
    gate = EnrolAdmission(per_source_per_s=5, per_source_burst=20, total_per_s=50,
                          total_burst=100)
    for _ in range(20):
        gate.admit("10.0.0.1", t)
    for _ in range(5):
        with pytest.raises(ResourceExhausted, match=r"from 10\.0\.0\.1"):
            gate.admit("10.0.0.1", t)
    for i in range(80):
        gate.admit(f"10.1.0.{i}", t)
    with pytest.raises(ResourceExhausted, match=r"at most 50/s in all"):
        gate.admit("10.2.0.1", t)
    gate.admit("10.2.0.1", t + 0.1)  # 5 refilled in 0.1 s


def test_admission_tracks_a_bounded_number_of_sources() -> None:
    gate = EnrolAdmission(per_source_burst=1, total_per_s=1e9, total_burst=1e9, max_sources=3)
    for source in ("a", "b", "c", "d"):
        gate.admit(source, 0.0)
    gate.admit("a", 0.0)  # forgotten (least recently seen): a fresh bucket
    with pytest.raises(ResourceExhausted):
        gate.admit("d", 0.0)


@pytest.mark.parametrize(("peer", "source"), [
    ("ipv4:10.0.0.7:51234", "10.0.0.7"), ("ipv6:[fd00::7]:51234", "fd00::7"),
    ("ipv6:%5B::1%5D:443", "::1"), ("unix:/run/x.sock", "unix"), ("", "unknown")])
def test_peer_source_is_the_address_without_the_port(peer: str, source: str) -> None:
    assert peer_source(peer) == source


class _Context:
    """What Enrol reads of a gRPC call: the peer."""

    def __init__(self, peer: str) -> None:
        self._peer = peer

    def peer(self) -> str:
        return self._peer


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def sqlite_store(tmp_path: Any) -> Any:
    store = Store.open(default_sqlite_url(tmp_path))
    yield store
    store.close()


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> SigningCa:
    made = init_certs(tmp_path_factory.mktemp("certs"), hosts=[], days=1)
    return SigningCa.load(made["ca"], made["ca-key"])


def _samples(metrics: ControllerMetrics) -> dict[str, float]:
    return {s.labels["outcome"]: s.value for m in metrics.registry.collect()
            if m.name == "gearshift_controller_enrolments"
            for s in m.samples if s.name.endswith("_total")}


async def test_enrol_refuses_by_rate_before_parsing_and_logs_one_summary_line(
        sqlite_store: Store, ca: SigningCa, caplog: pytest.LogCaptureFixture) -> None:
    es = EnrolmentStore(sqlite_store.engine)
    metrics = ControllerMetrics(registry=CollectorRegistry())
    clock = _Clock()
    service = EnrolService(es, ca, 60.0, Revocations(es), metrics.enrolments, clock=clock,
                           refusal_log_interval_s=3600.0)
    # A well-formed but unknown token, and a CSR that does not parse: each admitted
    # request is refused for its CSR; a rate-limited one never gets that far.
    bad = enrol_pb2.EnrolRequest(bootstrap_token="0a1b2c3d." + "x" * 43,
                                 csr_pem=b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n")
    caplog.set_level(logging.INFO, logger="gearshift.controller.enrolment.service")
    codes = []
    for i in range(1000):
        clock.now = 100.0 + i * 0.002  # 1,000 requests in 2 s from one address
        try:
            await service.Enrol(bad, _Context("ipv4:203.0.113.9:40000"))  # type: ignore[arg-type]
        except GearshiftError as exc:  # the kind of refusal is what is compared
            codes.append(type(exc).__name__)
    admitted = codes.count("InvalidArgument")
    assert 20 + 5 * 2 - 1 <= admitted <= 20 + 5 * 2 + 1  # the burst, then 5/s
    assert codes.count("ResourceExhausted") == 1000 - admitted
    assert _samples(metrics) == {"refused": admitted, "rate_limited": 1000 - admitted}
    assert not caplog.records  # no line per request
    line = service.log_refusals()
    assert line == (f"refused 1000 enrolment requests in the last 3600 s: {1000 - admitted} "
                    f"rate limited, {admitted} invalid request, from 1 source")
    assert [r.getMessage() for r in caplog.records] == [line]
    assert service.log_refusals() is None  # a fresh interval


async def test_refusal_summary_is_logged_once_per_interval_by_itself(
        sqlite_store: Store, ca: SigningCa, caplog: pytest.LogCaptureFixture) -> None:
    es = EnrolmentStore(sqlite_store.engine)
    service = EnrolService(es, ca, 60.0, Revocations(es), refusal_log_interval_s=0.2)
    made = _token(es, auto_approve=False, host_pattern="gpu-1")
    _enrol(es, made, _csr())
    es.approve("gpu-1")
    caplog.set_level(logging.WARNING, logger="gearshift.controller.enrolment.service")
    wrong = enrol_pb2.EnrolRequest(bootstrap_token=f"{made[0]}." + "y" * 43,
                                   csr_pem=_csr()[1])
    taken = enrol_pb2.EnrolRequest(bootstrap_token=f"{made[0]}.{made[1]}", csr_pem=_csr()[1])
    for request, peer in ((wrong, "ipv4:10.0.0.1:1"), (wrong, "ipv4:10.0.0.2:1"),
                          (taken, "ipv4:10.0.0.3:1")):
        with pytest.raises(PermissionDenied if request is wrong else FailedPrecondition):
            await service.Enrol(request, _Context(peer))  # type: ignore[arg-type]
    assert not caplog.records
    await asyncio.sleep(0.4)
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith(
        "refused 3 enrolment requests in the last 0.2 s: 2 bad token, 1 refused by the "
        "rules, from 3 sources; the last refused by the rules: host 'gpu-1' is approved "
        "for another key"), line
    assert line.endswith("after `gearshift hosts reset gpu-1` (docs/enrolment.md)"), line
    assert es.get("gpu-1").state == EnrolmentState.APPROVED  # type: ignore[union-attr]
