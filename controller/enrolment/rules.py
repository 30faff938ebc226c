"""Rules of enrolment by bootstrap token, without I/O (docs/enrolment.md).

- A bootstrap token is ``<id>.<secret>``: `id` (8 lowercase hex digits) names it in
  lists and logs, `secret` (URL-safe base64) proves it. The store keeps the id and
  the SHA-256 of the secret only (`hash_secret`); a secret of 32 random bytes needs
  no slow hash.
- A token allows what it carries (`TokenGrant`): host ids matching a glob
  (`host_pattern`), until `expires`, once or many times, with or without automatic
  approval. `check_token` says why a token does not allow a host, naming the token.
- `parse_csr` reads a certificate request and returns the one host it names (the
  URI SAN ``spiffe://gearshift/host/<host>``; a CN, if any, must say the same);
  anything else is `InvalidArgument` naming what is wrong.
- `decide` turns the stored facts (token, the host's enrolment) into one outcome:
  issue, wait for approval, or refuse. Enrolment never hands an enrolled host's id to
  a new key: an enrolled host renews with its certificate (`check_renewal`), and one
  that lost its key enrols again only after `gearshift hosts reset HOST`.
- `EnrolAdmission` limits the rate of enrolment requests, per source address and
  overall (token buckets), before any costly work; `RefusalTally` sums refusals up
  for one log line per interval instead of one per request.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gearshift.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
)
from gearshift.common.identity import HOST_URI_PREFIX

TOKEN_ID_HEX_CHARS = 8
TOKEN_SECRET_BYTES = 32
MAX_TOKEN_CHARS = 128
MAX_CSR_BYTES = 16 * 1024
MAX_PATTERN_CHARS = 253
KEY_FINGERPRINT_HEX_CHARS = 16
_TOKEN_RE = re.compile(r"^([0-9a-f]{8})\.([A-Za-z0-9_-]{20,100})$")
_HOST_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_PATTERN_RE = re.compile(r"^[A-Za-z0-9._*?\[\]!-]+$")



class EnrolmentState(StrEnum):
    """Where one host's enrolment stands (stored as its value)."""

    PENDING = "pending"    # asked with a token that does not auto-approve; waits for a person
    APPROVED = "approved"  # certificates may be issued to it (and renewed)
    REVOKED = "revoked"    # refused everywhere: streams, hellos, enrolment, renewal
    RESET = "reset"        # `hosts reset`: its old certificate refused; its next enrolment
    #                        with a valid token is a first one


@dataclass(frozen=True)
class NewToken:
    """A freshly made token: what is shown once, and what is stored."""

    token_id: str
    secret_token: str  # "<id>.<secret>"
    secret_hash: str


def new_token() -> NewToken:
    token_id = secrets.token_hex(TOKEN_ID_HEX_CHARS // 2)
    secret = secrets.token_urlsafe(TOKEN_SECRET_BYTES)
    return NewToken(token_id, f"{token_id}.{secret}", hash_secret(secret))


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def split_token(token: str) -> tuple[str, str]:
    """(id, secret) of a presented token; Unauthenticated when it is not one."""
    token = token.strip()
    if not token:
        raise Unauthenticated("no bootstrap token given")
    found = _TOKEN_RE.match(token) if len(token) <= MAX_TOKEN_CHARS else None
    if found is None:
        raise Unauthenticated("bootstrap token malformed (expected '<8 hex digits>.<secret>', "
                              "as `gearshift tokens create` prints it)")
    return found.group(1), found.group(2)


def secret_matches(secret: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret).encode(), stored_hash.encode())


def check_pattern(pattern: str) -> str:
    """A host-name glob a token may carry; InvalidArgument otherwise."""
    if not pattern or len(pattern) > MAX_PATTERN_CHARS or not _PATTERN_RE.match(pattern):
        raise InvalidArgument(
            f"--hosts: {pattern!r} is not a host-name pattern (letters, digits, '.', '_', '-' "
            "and the glob characters * ? [ ] !)")
    return pattern


def check_host_id(host: str, where: str = "host") -> str:
    if not _HOST_RE.match(host):
        raise InvalidArgument(
            f"{where}: {host!r} is not a host id (letters, digits, '.', '_', '-'; starting "
            "with a letter or digit; at most 63 characters)")
    return host


@dataclass(frozen=True)
class TokenGrant:
    """What a stored token allows."""

    token_id: str
    host_pattern: str
    expires: dt.datetime
    one_time: bool
    auto_approve: bool
    revoked: bool = False
    used_by: str | None = None  # one-time: the host that used it first
    spent: dt.datetime | None = None  # one-time: when a certificate was issued with it


class BadToken(PermissionDenied):
    """The token's id is unknown or its secret is wrong (counted apart from other refusals)."""


def check_token(grant: TokenGrant, host: str, now: dt.datetime) -> None:
    """Raise (naming the token and the rule) unless `grant` lets `host` enrol now."""
    name = f"bootstrap token {grant.token_id}"
    if grant.revoked:
        raise PermissionDenied(f"{name} is revoked")
    if now >= grant.expires:
        raise PermissionDenied(f"{name} expired at {grant.expires.isoformat(timespec='seconds')}")
    if not fnmatch.fnmatchcase(host, grant.host_pattern):
        raise PermissionDenied(
            f"{name} allows hosts matching {grant.host_pattern!r}; the request names {host!r}")
    if grant.one_time and grant.spent is not None:
        raise PermissionDenied(
            f"{name} is one-time and was spent: a certificate was issued with it to host "
            f"{grant.used_by!r} at {grant.spent.isoformat(timespec='seconds')}")
    if grant.one_time and grant.used_by is not None and grant.used_by != host:
        raise PermissionDenied(f"{name} is one-time and was used by host {grant.used_by!r}")


@dataclass(frozen=True)
class Csr:
    """A checked certificate request: the host it names and its public key."""

    host: str
    public_key: Any
    key_fingerprint: str


def key_fingerprint(public_key: Any) -> str:
    from cryptography.hazmat.primitives import serialization
    der = public_key.public_bytes(serialization.Encoding.DER,
                                  serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()[:KEY_FINGERPRINT_HEX_CHARS]


def parse_csr(pem: bytes) -> Csr:
    """The host a PEM certificate request names, checked; InvalidArgument naming the fault."""
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import NameOID

    if not pem:
        raise InvalidArgument("CSR: empty (expected a PEM certificate request)")
    if len(pem) > MAX_CSR_BYTES:
        raise InvalidArgument(f"CSR: larger than {MAX_CSR_BYTES} bytes")
    if not pem.isascii():  # PEM is ASCII; the request is stored as text while pending
        raise InvalidArgument("CSR: not ASCII (expected a PEM certificate request)")
    if b"-----BEGIN CERTIFICATE REQUEST-----" not in pem:
        raise InvalidArgument("CSR: not a PEM certificate request "
                              "(no '-----BEGIN CERTIFICATE REQUEST-----')")
    try:
        csr = x509.load_pem_x509_csr(pem)
        valid = csr.is_signature_valid
        key = csr.public_key()
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"CSR: cannot be parsed: {exc}") from None
    if not valid:
        raise InvalidArgument("CSR: its signature does not verify with its own key")
    if isinstance(key, ec.EllipticCurvePublicKey):
        if key.curve.name not in ("secp256r1", "secp384r1"):
            raise InvalidArgument(f"CSR: EC curve {key.curve.name} not accepted "
                                  "(P-256 or P-384)")
    elif isinstance(key, rsa.RSAPublicKey):
        if key.key_size < 2048:
            raise InvalidArgument(f"CSR: RSA key of {key.key_size} bits (at least 2048)")
    else:
        raise InvalidArgument(f"CSR: key type {type(key).__name__} not accepted (EC or RSA)")
    try:
        sans = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
        others = len(list(sans)) - len(uris)
    except x509.ExtensionNotFound:
        uris, others = [], 0
    except ValueError as exc:
        raise InvalidArgument(f"CSR: unreadable extensions: {exc}") from None
    hosts = [u[len(HOST_URI_PREFIX):] for u in uris if u.startswith(HOST_URI_PREFIX)]
    if len(hosts) != 1 or len(uris) != 1 or others:
        raise InvalidArgument(
            f"CSR: must name exactly one host as the only subject alternative name "
            f"({HOST_URI_PREFIX}<host>); found {', '.join(uris) or 'none'}"
            + (f" and {others} other name(s)" if others else ""))
    host = check_host_id(hosts[0], "CSR: host")
    cns = [a.value for a in csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if cns and cns != [host]:
        raise InvalidArgument(f"CSR: common name {cns[0]!r} differs from the host {host!r} "
                              "its URI names")
    return Csr(host, key, key_fingerprint(key))


class Outcome(StrEnum):
    ISSUE = "issue"
    PENDING = "pending"


@dataclass(frozen=True)
class Enrolled:
    """A host's stored enrolment, as far as the decision needs it."""

    state: EnrolmentState
    key_fingerprint: str
    issued: bool = False  # a certificate was issued for this enrolment (or renewed)


def _reset_hint(host: str) -> str:
    return (f"a host that lost its key enrols again after `gearshift hosts reset {host}` "
            "(docs/enrolment.md)")


def decide(grant: TokenGrant, csr: Csr, current: Enrolled | None, now: dt.datetime) -> Outcome:
    """Issue, or wait for approval; raise when the request is refused.

    Issued at once: a token that auto-approves, for a host that has no enrolment (or
    was reset), or a host a person approved for this very key (the request it
    approved, asked again). Enrolment never gives an enrolled host's id to a new key,
    whatever the token: an approved host that got its certificate renews with it, and
    an approved host asked for with another key is refused, its state untouched. A
    revoked host is refused whatever the token says.
    """
    if current is not None and current.state == EnrolmentState.REVOKED:
        raise PermissionDenied(f"host {csr.host!r} is revoked; it cannot enrol "
                               "(see `gearshift hosts list`)")
    check_token(grant, csr.host, now)
    if current is not None and current.state == EnrolmentState.APPROVED:
        if current.issued:
            raise FailedPrecondition(
                f"host {csr.host!r} is already enrolled (key {current.key_fingerprint}); "
                f"it renews with its certificate, and {_reset_hint(csr.host)}")
        if current.key_fingerprint != csr.key_fingerprint:
            raise FailedPrecondition(
                f"host {csr.host!r} is approved for another key ({current.key_fingerprint}, "
                f"this request has {csr.key_fingerprint}); {_reset_hint(csr.host)}")
        return Outcome.ISSUE
    if grant.auto_approve:
        return Outcome.ISSUE
    return Outcome.PENDING


def check_renewal(presented_host: str | None, csr: Csr, current: Enrolled | None) -> None:
    """A renewal: the presented certificate's host asks for itself, and is not revoked."""
    if presented_host is None:
        raise Unauthenticated("renewal needs the current certificate (mutual TLS) naming "
                              f"{HOST_URI_PREFIX}<host>")
    if csr.host != presented_host:
        raise PermissionDenied(f"certificate names {presented_host}, the CSR names {csr.host}")
    if current is not None and current.state == EnrolmentState.REVOKED:
        raise PermissionDenied(f"host {presented_host!r} is revoked")
    if current is not None and current.state == EnrolmentState.RESET:
        raise PermissionDenied(f"host {presented_host!r} was reset (`gearshift hosts reset`); "
                               "its certificate is refused until it enrols again")
    if current is not None and current.state == EnrolmentState.PENDING:
        raise PermissionDenied(f"host {presented_host!r} waits for approval; "
                               "renewal needs an approved host")


def check_reset(host: str, current: Enrolled | None) -> None:
    """`gearshift hosts reset HOST`: any enrolment but a revocation may be cleared."""
    if current is None:
        raise NotFound(f"host {host!r} has no enrolment to reset (see `gearshift hosts list`)")
    if current.state == EnrolmentState.REVOKED:
        raise FailedPrecondition(f"host {host!r} is revoked; a revoked host id stays revoked "
                                 "(a host that must come back joins under a new id)")


__all__ = ["BadToken", "Csr", "Enrolled", "EnrolmentState", "NewToken", "Outcome", "TokenGrant",
           "check_host_id", "check_pattern", "check_renewal", "check_reset", "check_token",
           "decide", "hash_secret", "key_fingerprint", "new_token", "parse_csr",
           "secret_matches", "split_token"]
