"""A private certificate authority, certificates and tokens for a test or small deployment.

Operators run it as `gearshift certs` (cli/certs.py holds only the commands);
the controller will sign agents' certificate requests with the same code.
`init_certs(DIR, …)` (`gearshift certs init --out DIR`) writes, with the
`cryptography` package:

| file | what |
| --- | --- |
| `ca.pem`, `ca-key.pem` | the private CA (self-signed, path length 0) |
| `controller.pem`, `controller-key.pem` | the controller's server certificate; SANs from `--controller-san` |
| `agent-<host>.pem`, `agent-<host>-key.pem` | one client certificate per agent host |
| `gateway.pem`, `gateway-key.pem` | the gateway's client certificate (URI `spiffe://gearshift/gateway`) |
| `cli.pem`, `cli-key.pem`, `cli-read.pem`, `cli-read-key.pem` | people's client certificates, of the roles admin and read (URIs `spiffe://gearshift/role/admin`, `…/role/read`) |
| `tokens.yaml`, `admin.token`, `read.token` | random bearer tokens for the two roles |

Identity: an agent certificate has CN `<host>` and one SAN URI
`spiffe://gearshift/host/<host>`; the controller trusts ONLY that URI SAN (see
`gearshift.controller.api.security.peer_host_id`), never the CN, so the gateway's and
people's certificates can never pass as a host, and a host's certificate is only ever
an agent's (docs/security.md: what each identity may call). Keys are ECDSA P-256. Private keys and token files are
written with mode 0600; existing files are never overwritten without `--force`.
`issue_agent_cert` (`gearshift certs issue --out DIR --host H`) adds an agent
certificate signed by the CA already in DIR (a new host, or a renewal).
`SigningCa` signs agents' certificate requests at enrolment (docs/enrolment.md):
the same identity, a short lifetime, the key made on the agent's host.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from gearshift.common.errors import ConfigError, FailedPrecondition
from gearshift.common.identity import (
    GATEWAY_URI,
    HOST_URI_PREFIX,
    ROLE_URI_PREFIX,
    SPIFFE_TRUST_DOMAIN,
)

DEFAULT_CONTROLLER_SANS: tuple[str, ...] = ("127.0.0.1", "localhost")
DEFAULT_VALIDITY_DAYS = 365
# Certificates start a little in the past so that small clock skew between hosts
# does not make a fresh certificate "not yet valid".
CLOCK_SKEW_ALLOWANCE_S = 300
TOKEN_BYTES = 32
SECRET_FILE_MODE = 0o600
PUBLIC_FILE_MODE = 0o644
_HOST_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def _crypto() -> Any:
    """Import `cryptography` lazily so that the rest of the CLI works without it."""
    try:
        import cryptography  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise FailedPrecondition(
            "gearshift certs needs the 'cryptography' package: pip install cryptography") from exc
    from cryptography import x509
    return x509


def check_host_name(host: str) -> str:
    """Return `host` if it can name an agent certificate, else raise ConfigError."""
    if not _HOST_RE.match(host):
        raise ConfigError(
            f"--hosts: {host!r} is not a host id (letters, digits, '.', '_', '-'; "
            "starting with a letter or digit; at most 63 characters)")
    return host


def _write(path: Path, data: bytes, mode: int) -> None:
    # Create with the final mode from the start: a key is never world-readable, even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chmod(path, mode)


def _refuse_existing(paths: Iterable[Path], force: bool) -> None:
    existing = [p for p in paths if p.exists()]
    if existing and not force:
        names = ", ".join(str(p) for p in existing)
        raise FailedPrecondition(f"refusing to overwrite {names} (use --force to replace)")


def _new_key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))


def _cert_pem(cert: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str) -> Any:
    x509 = _crypto()
    from cryptography.x509.oid import NameOID
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gearshift"),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])


def _san_entries(sans: Sequence[str]) -> list[Any]:
    x509 = _crypto()
    out: list[Any] = []
    for san in sans:
        san = san.strip()
        if not san:
            continue
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(san)))
        except ValueError:
            if not re.match(r"^[A-Za-z0-9*][A-Za-z0-9.*-]*$", san):
                raise ConfigError(
                    f"--controller-san: {san!r} is neither an IP address nor a DNS name") from None
            out.append(x509.DNSName(san))
    if not out:
        raise ConfigError("--controller-san: at least one IP address or DNS name is needed")
    return out


def _validity(now: dt.datetime | None, days: int) -> tuple[dt.datetime, dt.datetime]:
    if days < 1:
        raise ConfigError(f"--days: expected at least 1, found {days}")
    start = now if now is not None else dt.datetime.now(dt.UTC)
    if start.tzinfo is None:
        start = start.replace(tzinfo=dt.UTC)
    return start - dt.timedelta(seconds=CLOCK_SKEW_ALLOWANCE_S), start + dt.timedelta(days=days)


def _sign(subject_cn: str, public_key: Any, issuer: tuple[Any, Any] | None,
          window: tuple[dt.datetime, dt.datetime], *, server_sans: Sequence[str] = (),
          uri: str | None = None, own_key: Any = None) -> Any:
    """Build and sign one certificate. `issuer` is (ca_cert, ca_key); None: self-signed CA."""
    x509 = _crypto()
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    is_ca = issuer is None
    issuer_cert, signing_key = (None, own_key) if issuer is None else issuer
    issuer_name = _name(subject_cn) if issuer_cert is None else issuer_cert.subject
    builder = (x509.CertificateBuilder()
               .subject_name(_name(subject_cn)).issuer_name(issuer_name)
               .public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(window[0]).not_valid_after(window[1])
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=0 if is_ca else None),
                              critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key),
                              critical=False))
    if is_ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
    else:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(signing_key.public_key()),
            critical=False)
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=True, key_cert_sign=False, crl_sign=False,
            encipher_only=False, decipher_only=False), critical=True)
        usage = (ExtendedKeyUsageOID.SERVER_AUTH if server_sans
                 else ExtendedKeyUsageOID.CLIENT_AUTH)
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        entries = _san_entries(server_sans) if server_sans else []
        if uri:
            entries.append(x509.UniformResourceIdentifier(uri))
        if entries:
            builder = builder.add_extension(x509.SubjectAlternativeName(entries), critical=False)
    return builder.sign(signing_key, hashes.SHA256())


def _emit(out: dict[str, Path], out_dir: Path, stem: str, cert: Any, key: Any) -> None:
    cert_path, key_path = out_dir / f"{stem}.pem", out_dir / f"{stem}-key.pem"
    _write(key_path, _key_pem(key), SECRET_FILE_MODE)
    _write(cert_path, _cert_pem(cert), PUBLIC_FILE_MODE)
    out[stem], out[f"{stem}-key"] = cert_path, key_path


# The people's and the gateway's certificates and the identity (URI SAN) each carries:
# the controller decides what a caller may do by it (docs/security.md).
CLIENT_IDENTITIES = {"gateway": GATEWAY_URI, "cli": ROLE_URI_PREFIX + "admin",
                     "cli-read": ROLE_URI_PREFIX + "read"}


def _client_stems(hosts: Sequence[str]) -> list[str]:
    return [f"agent-{h}" for h in hosts] + list(CLIENT_IDENTITIES)


def init_certs(out_dir: Path | str, hosts: Sequence[str] = (),
               sans: Sequence[str] = DEFAULT_CONTROLLER_SANS, days: int = DEFAULT_VALIDITY_DAYS,
               *, now: dt.datetime | None = None, force: bool = False) -> dict[str, Path]:
    """Make a private CA, the controller, agent, gateway and CLI certificates, and tokens.

    Returns the written paths by name: "ca", "ca-key", "controller", "controller-key",
    "agent-<host>", "agent-<host>-key", "gateway", "gateway-key", "cli", "cli-key",
    "cli-read", "cli-read-key",
    "tokens" (tokens.yaml), "admin-token", "read-token". `now` moves the validity
    window (a past `now` with days=1 gives expired certificates for tests).
    """
    out_dir = Path(out_dir)
    hosts = [check_host_name(h) for h in hosts]
    if len(set(hosts)) != len(hosts):
        raise ConfigError(f"--hosts: duplicate host ids in {','.join(hosts)}")
    window = _validity(now, days)
    _san_entries(sans)  # check before writing anything
    stems = ["ca", "controller", *_client_stems(hosts)]
    targets = [out_dir / f"{s}{suffix}" for s in stems for suffix in (".pem", "-key.pem")]
    targets += [out_dir / n for n in ("tokens.yaml", "admin.token", "read.token")]
    _refuse_existing(targets, force)
    out_dir.mkdir(parents=True, exist_ok=True)

    out: dict[str, Path] = {}
    ca_key = _new_key()
    ca_cert = _sign("gearshift private CA", ca_key.public_key(), None, window, own_key=ca_key)
    _emit(out, out_dir, "ca", ca_cert, ca_key)
    key = _new_key()
    _emit(out, out_dir, "controller",
          _sign("gearshift-controller", key.public_key(), (ca_cert, ca_key), window,
                server_sans=list(sans)), key)
    for host in hosts:
        key = _new_key()
        _emit(out, out_dir, f"agent-{host}",
              _sign(host, key.public_key(), (ca_cert, ca_key), window,
                    uri=HOST_URI_PREFIX + host), key)
    for stem, uri in CLIENT_IDENTITIES.items():
        key = _new_key()
        _emit(out, out_dir, stem,
              _sign(f"gearshift-{stem}", key.public_key(), (ca_cert, ca_key), window, uri=uri),
              key)
    out.update(_write_tokens(out_dir))
    return out


def _write_tokens(out_dir: Path) -> dict[str, Path]:
    admin, read = secrets.token_urlsafe(TOKEN_BYTES), secrets.token_urlsafe(TOKEN_BYTES)
    tokens = out_dir / "tokens.yaml"
    _write(tokens, (
        "# gearshift bearer tokens: role -> token (or a list of tokens). Keep this file secret.\n"
        f'admin: "{admin}"\nread: "{read}"\n').encode(), SECRET_FILE_MODE)
    _write(out_dir / "admin.token", f"{admin}\n".encode(), SECRET_FILE_MODE)
    _write(out_dir / "read.token", f"{read}\n".encode(), SECRET_FILE_MODE)
    return {"tokens": tokens, "admin-token": out_dir / "admin.token",
            "read-token": out_dir / "read.token"}


def _load_ca(out_dir: Path) -> tuple[Any, Any]:
    x509 = _crypto()
    from cryptography.hazmat.primitives import serialization
    ca_path, key_path = out_dir / "ca.pem", out_dir / "ca-key.pem"
    for p in (ca_path, key_path):
        if not p.is_file():
            raise ConfigError(f"{p}: not found (run `gearshift certs init --out {out_dir}` first)")
    try:
        cert = x509.load_pem_x509_certificate(ca_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except ValueError as exc:
        raise ConfigError(f"{ca_path}: cannot load the CA certificate and key: {exc}") from None
    return cert, key


def issue_agent_cert(out_dir: Path | str, host: str, days: int = DEFAULT_VALIDITY_DAYS,
                     *, now: dt.datetime | None = None, force: bool = False) -> dict[str, Path]:
    """Sign `agent-<host>.pem`/`-key.pem` with the CA in `out_dir` (new host or renewal)."""
    out_dir = Path(out_dir)
    host = check_host_name(host)
    stem = f"agent-{host}"
    _refuse_existing([out_dir / f"{stem}.pem", out_dir / f"{stem}-key.pem"], force)
    ca = _load_ca(out_dir)
    key = _new_key()
    out: dict[str, Path] = {}
    _emit(out, out_dir, stem, _sign(host, key.public_key(), ca, _validity(now, days),
                                    uri=HOST_URI_PREFIX + host), key)
    return out


class SigningCa:
    """The CA certificate and key a controller signs enrolled agents' certificates with."""

    def __init__(self, cert: Any, key: Any) -> None:
        self.cert, self.key = cert, key
        self.cert_pem = _cert_pem(cert)

    @classmethod
    def load(cls, cert_path: Path | str, key_path: Path | str) -> SigningCa:
        """`--tls-ca` and `--ca-key`; ConfigError naming the file when they do not fit."""
        x509 = _crypto()
        from cryptography.hazmat.primitives import serialization
        try:
            cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--tls-ca {cert_path}: cannot load the CA certificate: "
                              f"{exc}") from None
        try:
            key = serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"--ca-key {key_path}: cannot load the CA private key: "
                              f"{exc}") from None
        pub = serialization.PublicFormat.SubjectPublicKeyInfo
        der = serialization.Encoding.DER
        if key.public_key().public_bytes(der, pub) != cert.public_key().public_bytes(der, pub):
            raise ConfigError(f"--ca-key {key_path}: not the key of the CA in {cert_path}")
        return cls(cert, key)

    def sign_host(self, host: str, public_key: Any, ttl_s: float,
                  now: dt.datetime | None = None) -> Any:
        """A client certificate for `host` (URI SAN only) valid for `ttl_s` seconds."""
        start = now or dt.datetime.now(dt.UTC)
        skew = dt.timedelta(seconds=min(CLOCK_SKEW_ALLOWANCE_S, ttl_s))
        window = (start - skew, start + dt.timedelta(seconds=ttl_s))
        return _sign(check_host_name(host), public_key, (self.cert, self.key), window,
                     uri=HOST_URI_PREFIX + host)

    @staticmethod
    def pem(cert: Any) -> bytes:
        return _cert_pem(cert)


__all__ = ["DEFAULT_CONTROLLER_SANS", "DEFAULT_VALIDITY_DAYS", "HOST_URI_PREFIX",
           "SPIFFE_TRUST_DOMAIN", "SigningCa", "check_host_name", "init_certs", "issue_agent_cert"]
