"""Enrolment rules (tokens, certificate requests, the decision) and their store, on
SQLite and PostgreSQL: a refused request stores nothing; a one-time token binds to
its first host; approval and revocation."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from gearshift.agents.enrolment import make_csr
from gearshift.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
)
from gearshift.controller.enrolment.certificate_authority import SigningCa, init_certs
from gearshift.controller.enrolment.rules import (
    Csr,
    Enrolled,
    EnrolmentState,
    Outcome,
    TokenGrant,
    check_pattern,
    check_renewal,
    decide,
    new_token,
    parse_csr,
    secret_matches,
    split_token,
)
from gearshift.controller.enrolment.store import EnrolmentStore
from gearshift.controller.store.database import Store

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)


def _key() -> Any:
    return ec.generate_private_key(ec.SECP256R1())


def _csr(host: str = "gpu-1", key: Any = None) -> Csr:
    return parse_csr(make_csr(host, key or _key()))


def _raw_csr(key: Any, cn: str | None, uris: list[str], dns: list[str] = ()) -> bytes:  # type: ignore[assignment]
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)] if cn else []))
    names = [x509.UniformResourceIdentifier(u) for u in uris] + [x509.DNSName(d) for d in dns]
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def grant(**overrides: Any) -> TokenGrant:
    fields: dict[str, Any] = {"token_id": "0a1b2c3d", "host_pattern": "gpu-*",
                              "expires": NOW + dt.timedelta(hours=1), "one_time": False,
                              "auto_approve": True}
    fields.update(overrides)
    return TokenGrant(**fields)


# -- tokens ----------------------------------------------------------------------

def test_new_token_splits_back_and_only_its_secret_matches_the_hash() -> None:
    made = new_token()
    token_id, secret = split_token(made.secret_token)
    assert token_id == made.token_id and len(token_id) == 8
    assert secret not in made.secret_hash and secret_matches(secret, made.secret_hash)
    assert not secret_matches(secret + "x", made.secret_hash)


@pytest.mark.parametrize("bad", ["", "abc", "0A1B2C3D.abcdefghijklmnopqrstuvwxyz",
                                 "0a1b2c3d", "0a1b2c3d.short", "0a1b2c3d." + "x" * 200,
                                 "0a1b2c3d.abcdefghijkl mnopqrstuvwxyz"])
def test_malformed_tokens_are_unauthenticated_with_the_expected_shape(bad: str) -> None:
    with pytest.raises(Unauthenticated, match="bootstrap token"):
        split_token(bad)


@pytest.mark.parametrize(("rule", "host", "message"), [
    ({"revoked": True}, "gpu-1", "bootstrap token 0a1b2c3d is revoked"),
    ({"expires": NOW}, "gpu-1", "bootstrap token 0a1b2c3d expired at 2026-12-01T12:00:00"),
    ({}, "cpu-1", "allows hosts matching 'gpu-\\*'; the request names 'cpu-1'"),
    ({"one_time": True, "used_by": "gpu-2"}, "gpu-1", "one-time and was used by host 'gpu-2'"),
])
def test_token_rules_refuse_naming_the_token_and_the_rule(rule: dict, host: str,
                                                          message: str) -> None:
    with pytest.raises(PermissionDenied, match=message):
        decide(grant(**rule), _csr(host), None, NOW)


def test_a_one_time_token_lets_its_own_host_ask_again() -> None:
    assert decide(grant(one_time=True, used_by="gpu-1"), _csr("gpu-1"), None,
                  NOW) == Outcome.ISSUE


@pytest.mark.parametrize("pattern", ["", "gpu 1", "gpu/1", "a" * 300, "gpu-*;rm"])
def test_bad_patterns_are_refused(pattern: str) -> None:
    with pytest.raises(InvalidArgument, match="host-name pattern"):
        check_pattern(pattern)


# -- certificate requests ----------------------------------------------------------

def test_a_csr_names_its_host_and_key() -> None:
    key = _key()
    csr = parse_csr(make_csr("gpu-1", key))
    assert csr.host == "gpu-1" and len(csr.key_fingerprint) == 16
    assert csr.key_fingerprint == parse_csr(make_csr("gpu-1", key)).key_fingerprint


@pytest.mark.parametrize(("pem", "message"), [
    (b"", "CSR: empty"),
    (b"hello", "not a PEM certificate request"),
    (b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
     "cannot be parsed"),
    (b"-----BEGIN CERTIFICATE REQUEST-----" + b"A" * 20000, "larger than"),
])
def test_malformed_csrs_are_named(pem: bytes, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        parse_csr(pem)


@pytest.mark.parametrize(("cn", "uris", "dns", "message"), [
    ("gpu-1", [], [], "must name exactly one host"),
    ("gpu-1", ["spiffe://gearshift/host/gpu-1", "spiffe://gearshift/host/gpu-2"], [],
     "must name exactly one host"),
    ("gpu-1", ["spiffe://gearshift/gateway"], [], "must name exactly one host"),
    ("gpu-1", ["spiffe://gearshift/host/gpu-1"], ["controller.internal"], "1 other name"),
    ("gpu-2", ["spiffe://gearshift/host/gpu-1"], [], "common name 'gpu-2' differs"),
    (None, ["spiffe://gearshift/host/bad host"], [], "is not a host id"),
])
def test_csrs_naming_anything_but_one_host_are_refused(cn: str | None, uris: list[str],
                                                       dns: list[str], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        parse_csr(_raw_csr(_key(), cn, uris, dns))


def test_weak_keys_and_forged_signatures_are_refused() -> None:
    small = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    with pytest.raises(InvalidArgument, match="RSA key of 1024 bits"):
        parse_csr(_raw_csr(small, "gpu-1", ["spiffe://gearshift/host/gpu-1"]))
    pem = make_csr("gpu-1", _key())
    der = x509.load_pem_x509_csr(pem).public_bytes(serialization.Encoding.DER)
    forged = bytearray(der)
    forged[-5] ^= 0xFF  # inside the signature
    import base64
    body = base64.encodebytes(bytes(forged))
    forged_pem = (b"-----BEGIN CERTIFICATE REQUEST-----\n" + body +
                  b"-----END CERTIFICATE REQUEST-----\n")
    with pytest.raises(InvalidArgument, match="signature does not verify"):
        parse_csr(forged_pem)


# -- the decision ----------------------------------------------------------------

def test_decide_pending_then_issue_for_the_approved_key_only() -> None:
    csr = _csr()
    assert decide(grant(auto_approve=False), csr, None, NOW) == Outcome.PENDING
    approved = Enrolled(EnrolmentState.APPROVED, csr.key_fingerprint)
    assert decide(grant(auto_approve=False), csr, approved, NOW) == Outcome.ISSUE
    # Another key for an approved host: refused, the approval untouched (hosts reset first).
    with pytest.raises(FailedPrecondition, match="hosts reset gpu-1"):
        decide(grant(auto_approve=False), _csr(), approved, NOW)
    with pytest.raises(PermissionDenied, match="host 'gpu-1' is revoked"):
        decide(grant(), csr, Enrolled(EnrolmentState.REVOKED, ""), NOW)


def test_renewal_rules() -> None:
    csr = _csr("gpu-1")
    check_renewal("gpu-1", csr, Enrolled(EnrolmentState.APPROVED, ""))
    check_renewal("gpu-1", csr, None)  # a pre-made certificate's host
    with pytest.raises(Unauthenticated, match="current certificate"):
        check_renewal(None, csr, None)
    with pytest.raises(PermissionDenied, match="certificate names gpu-2, the CSR names gpu-1"):
        check_renewal("gpu-2", csr, None)
    with pytest.raises(PermissionDenied, match="revoked"):
        check_renewal("gpu-1", csr, Enrolled(EnrolmentState.REVOKED, ""))


def test_signing_ca_checks_its_key_and_signs_short_lived_host_certificates(tmp_path) -> None:  # type: ignore[no-untyped-def]
    mine, other = tmp_path / "mine", tmp_path / "other"
    init_certs(mine, days=1)
    init_certs(other, days=1)
    with pytest.raises(Exception, match="not the key of the CA"):
        SigningCa.load(mine / "ca.pem", other / "ca-key.pem")
    with pytest.raises(Exception, match="cannot load the CA private key"):
        SigningCa.load(mine / "ca.pem", mine / "ca.pem")
    ca = SigningCa.load(mine / "ca.pem", mine / "ca-key.pem")
    cert = ca.sign_host("gpu-1", _key().public_key(), 60.0, now=NOW)
    assert cert.not_valid_after_utc - cert.not_valid_before_utc == dt.timedelta(seconds=120)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://gearshift/host/gpu-1"]
    cert.verify_directly_issued_by(ca.cert)


# -- the store (SQLite and PostgreSQL) ----------------------------------------------

def _signer(csr: Csr) -> tuple[bytes, dt.datetime]:
    return b"-----BEGIN CERTIFICATE-----\n", NOW + dt.timedelta(hours=1)


def _tables(store: Store) -> tuple[list, list]:
    es = EnrolmentStore(store.engine)
    return [t.model_dump() for t in es.list_tokens()], [h.model_dump() for h in es.list()]


def test_store_refusals_store_nothing(store: Store) -> None:
    es = EnrolmentStore(store.engine, clock=lambda: NOW)
    made = new_token()
    es.add_token(made, host_pattern="gpu-*", ttl_s=3600, one_time=True, auto_approve=True,
                 description="")
    before = _tables(store)
    with pytest.raises(PermissionDenied, match="unknown or its secret is wrong"):
        es.enrol(made.token_id, "wrong-secret-xxxxxxxxxxxx", _csr("gpu-1"), "pem", _signer)
    with pytest.raises(PermissionDenied, match="the request names 'cpu-1'"):
        es.enrol(made.token_id, split_token(made.secret_token)[1], _csr("cpu-1"), "pem",
                 _signer)

    def failing_signer(csr: Csr) -> tuple[bytes, dt.datetime]:
        raise FailedPrecondition("no CA")

    with pytest.raises(FailedPrecondition):
        es.enrol(made.token_id, split_token(made.secret_token)[1], _csr("gpu-1"), "pem",
                 failing_signer)
    assert _tables(store) == before  # nothing half-way: not even the token's use


def test_store_one_time_token_pending_approve_and_revoke(store: Store) -> None:
    es = EnrolmentStore(store.engine, clock=lambda: NOW)
    made = new_token()
    es.add_token(made, host_pattern="gpu-?", ttl_s=3600, one_time=True, auto_approve=False,
                 description="rack 4")
    secret = split_token(made.secret_token)[1]
    key = _key()
    outcome, cert, _, message = es.enrol(made.token_id, secret, _csr("gpu-1", key), "pem",
                                         _signer)
    assert outcome == Outcome.PENDING and cert == b"" and "hosts approve gpu-1" in message
    assert [h.host_id for h in es.list(pending_only=True)] == ["gpu-1"]
    with pytest.raises(PermissionDenied, match="used by host 'gpu-1'"):
        es.enrol(made.token_id, secret, _csr("gpu-2"), "pem", _signer)
    assert es.approve("gpu-1").state == EnrolmentState.APPROVED
    outcome, cert, not_after, _ = es.enrol(made.token_id, secret, _csr("gpu-1", key), "pem",
                                           _signer)
    assert outcome == Outcome.ISSUE and cert and not_after is not None
    row = es.get("gpu-1")
    assert row is not None and row.csr_pem is None and row.cert_not_after == not_after
    assert es.list_tokens()[0].uses == 2 and es.list_tokens()[0].used_by == "gpu-1"

    assert es.revoke("gpu-1", "decommissioned").state == EnrolmentState.REVOKED
    assert es.revoke("gpu-7").state == EnrolmentState.REVOKED  # a pre-made host, too
    assert es.revoked_hosts() == {"gpu-1", "gpu-7"}
    with pytest.raises(PermissionDenied, match="host 'gpu-1' is revoked"):
        es.enrol(made.token_id, secret, _csr("gpu-1", key), "pem", _signer)
    with pytest.raises(FailedPrecondition, match="cannot be approved again"):
        es.approve("gpu-1")
    with pytest.raises(NotFound, match="has not asked to enrol"):
        es.approve("gpu-9")
    with pytest.raises(NotFound, match="no bootstrap token"):
        es.revoke_token("ffffffff")
    assert es.revoke_token(made.token_id).revoked is not None
