"""The agent's identity when it joins by bootstrap token (docs/enrolment.md).

`Identity` is the key and certificate the agent made and was given, in one file
``<workdir>/identity/agent.pem`` (the certificate, then the private key; mode
0600; replaced atomically, so a crash never leaves a key without its certificate).
The key is made here and never leaves the host.

`Enroller.ensure()` reuses a certificate that is still valid for this host and this
CA; otherwise it makes a key, asks the controller's enrolment listener to sign a
request naming ``spiffe://gearshift/host/<host>`` with the bootstrap token, and
waits (retrying with backoff, saying so in the log) while the request waits for
`gearshift hosts approve HOST`. `Enroller.renew_forever()` asks, at two thirds of
the certificate's lifetime, for a certificate for a new key over mutual TLS with
the current one; the agent's open stream is not touched: the new file is used by
its next connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gearshift.common.credentials import TlsFiles, secure_channel
from gearshift.common.endpoints import ControllerEndpoints
from gearshift.common.errors import ConfigError
from gearshift.common.identity import HOST_URI_PREFIX

log = logging.getLogger(__name__)

IDENTITY_DIR = "identity"
IDENTITY_FILE = "agent.pem"
RENEW_AT_FRACTION = 2 / 3
BACKOFF_INITIAL_S = 1.0
BACKOFF_MAX_S = 30.0
RPC_TIMEOUT_S = 15.0
BOOTSTRAP_TOKEN_ENV = "GEARSHIFT_BOOTSTRAP_TOKEN"
BOOTSTRAP_TOKEN_FILE_ENV = "GEARSHIFT_BOOTSTRAP_TOKEN_FILE"
# A token file holding this says "no token" (the systemd unit's default credential once
# the operator has removed the token file of a host that has joined).
NO_TOKEN = "none"
# Refusals a retry cannot cure: said once, clearly, then asked again slowly (an
# operator may fix the token or the host's state meanwhile).
FINAL_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
               grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION)


def load_bootstrap_token(path: Path | None, environ: dict[str, str] | None = None) -> str:
    """The bootstrap token from `path`, `$GEARSHIFT_BOOTSTRAP_TOKEN_FILE` or
    `$GEARSHIFT_BOOTSTRAP_TOKEN` (never from the command line)."""
    env = dict(os.environ) if environ is None else environ
    source = path or (Path(env[BOOTSTRAP_TOKEN_FILE_ENV]) if env.get(BOOTSTRAP_TOKEN_FILE_ENV)
                      else None)
    if source is not None:
        try:
            token = source.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"bootstrap token file {source}: cannot read: "
                              f"{exc.strerror or exc}") from None
        if token == NO_TOKEN:
            raise ConfigError(f"bootstrap token file {source} says {NO_TOKEN!r} and this host "
                              "has no valid certificate: put a token from `gearshift tokens "
                              "create` there (/etc/gearshift/bootstrap.token under systemd)")
        if not token or any(c.isspace() for c in token):
            raise ConfigError(f"bootstrap token file {source}: expected one token on one line")
        return token
    token = env.get(BOOTSTRAP_TOKEN_ENV, "").strip()
    if not token:
        raise ConfigError("no valid certificate and no bootstrap token: give "
                          "bootstrap_token_file (--bootstrap-token-file) or "
                          f"${BOOTSTRAP_TOKEN_FILE_ENV} / ${BOOTSTRAP_TOKEN_ENV}")
    return token


def _x509() -> Any:
    from cryptography import x509
    return x509


def new_key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return bytes(key.private_bytes(serialization.Encoding.PEM,
                                   serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption()))


def make_csr(host: str, key: Any) -> bytes:
    """A PKCS#10 request naming `host` (CN and the one URI SAN the controller trusts)."""
    x509 = _x509()
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gearshift"),
                                    x509.NameAttribute(NameOID.COMMON_NAME, host)]))
           .add_extension(x509.SubjectAlternativeName(
               [x509.UniformResourceIdentifier(HOST_URI_PREFIX + host)]), critical=False)
           .sign(key, hashes.SHA256()))
    return bytes(csr.public_bytes(serialization.Encoding.PEM))


@dataclass(frozen=True)
class Issued:
    """A certificate this agent holds: its window and its PEM."""

    not_before: dt.datetime
    not_after: dt.datetime

    def renew_at(self) -> dt.datetime:
        return self.not_before + (self.not_after - self.not_before) * RENEW_AT_FRACTION


class Identity:
    """``<workdir>/identity/agent.pem``: this host's certificate and key (see module doc)."""

    def __init__(self, workdir: Path, ca: Path, host: str, server_name: str | None = None
                 ) -> None:
        self.dir = Path(workdir) / IDENTITY_DIR
        self.path = self.dir / IDENTITY_FILE
        self.ca, self.host, self.server_name = Path(ca), host, server_name

    def tls_files(self) -> TlsFiles:
        return TlsFiles(self.ca, self.path, self.path, self.server_name)

    def save(self, cert_pem: bytes, key: Any) -> Issued:
        """Check the certificate against the CA, host and key, then replace the file."""
        issued = self._check(cert_pem, key)
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        tmp = self.dir / f".{IDENTITY_FILE}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(cert_pem + key_pem(key))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        return issued

    def load(self, now: dt.datetime | None = None) -> Issued | None:
        """The stored certificate when it is valid now for this host, CA and key; else None
        (and the log says why)."""
        if not self.path.exists():
            return None
        from cryptography.hazmat.primitives import serialization
        try:
            data = self.path.read_bytes()
            key = serialization.load_pem_private_key(data, password=None)
            issued = self._check(data, key)
        except (OSError, ValueError, TypeError) as exc:
            log.warning("stored certificate %s not usable: %s", self.path, exc)
            return None
        now = now or dt.datetime.now(dt.UTC)
        if not issued.not_before <= now < issued.not_after:
            log.info("stored certificate %s expired at %s", self.path,
                     issued.not_after.isoformat(timespec="seconds"))
            return None
        return issued

    def _check(self, cert_pem: bytes, key: Any) -> Issued:
        x509 = _x509()
        from cryptography.hazmat.primitives import serialization
        cert = x509.load_pem_x509_certificate(cert_pem)
        ca = x509.load_pem_x509_certificate(self.ca.read_bytes())
        try:
            cert.verify_directly_issued_by(ca)
        except Exception as exc:
            raise ValueError(f"not issued by the CA in {self.ca}: {exc}") from None
        spki = serialization.PublicFormat.SubjectPublicKeyInfo
        der = serialization.Encoding.DER
        if cert.public_key().public_bytes(der, spki) != key.public_key().public_bytes(der, spki):
            raise ValueError("the certificate is not for this key")
        try:
            sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
        except x509.ExtensionNotFound:
            uris = []
        if uris != [HOST_URI_PREFIX + self.host]:
            raise ValueError(f"the certificate names {', '.join(uris) or 'no host'}, this "
                             f"agent is {self.host}")
        return Issued(cert.not_valid_before_utc, cert.not_valid_after_utc)


class Enroller:
    """Gets and renews this host's certificate (see the module doc)."""

    def __init__(self, identity: Identity, enrol_addresses: str,
                 token: Callable[[], str], *, controllers: ControllerEndpoints,
                 backoff_max_s: float = BACKOFF_MAX_S) -> None:
        self.identity = identity
        self.enrol_endpoints = ControllerEndpoints(enrol_addresses, "enrol_controller")
        self.controllers = controllers  # renewal goes to the mutual-TLS port
        self._token = token
        self.backoff_max_s = backoff_max_s
        self.issued: Issued | None = None
        self.renewals = 0

    async def ensure(self, stopping: asyncio.Event) -> bool:
        """A valid certificate in the identity file; False if `stopping` came first."""
        self.issued = self.identity.load()
        if self.issued is not None:
            log.info("using the stored certificate of %s (valid until %s)", self.identity.host,
                     self.issued.not_after.isoformat(timespec="seconds"))
            return True
        token = self._token()  # read only when needed; a ConfigError stops the agent
        key = new_key()  # made here; never sent anywhere
        csr = make_csr(self.identity.host, key)
        from gearshift.v1 import enrol_pb2, enrol_pb2_grpc
        backoff = BACKOFF_INITIAL_S
        said: str | None = None
        while not stopping.is_set():
            addr = self.enrol_endpoints.current
            delay = 0.0
            try:
                async with secure_channel(addr, TlsFiles(self.identity.ca, None, None,
                                                         self.identity.server_name)) as ch:
                    resp = await enrol_pb2_grpc.EnrolServiceStub(ch).Enrol(
                        enrol_pb2.EnrolRequest(bootstrap_token=token, csr_pem=csr),
                        timeout=RPC_TIMEOUT_S)
                if resp.status == enrol_pb2.ENROL_STATUS_ISSUED:
                    self.issued = self.identity.save(resp.certificate_pem, key)
                    log.info("enrolled as %s: certificate valid until %s", self.identity.host,
                             self.issued.not_after.isoformat(timespec="seconds"))
                    return True
                if said != resp.message:
                    log.warning("enrolment of %s is pending at %s: %s", self.identity.host,
                                addr, resp.message)
                    said = resp.message
                else:
                    log.info("still waiting for approval of %s", self.identity.host)
                delay = max(resp.retry_after_s, BACKOFF_INITIAL_S)
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details()  # type: ignore[attr-defined]
                if code in FINAL_CODES:
                    if said != details:
                        log.error("enrolment refused by %s: %s", addr, details)
                        said = details
                    delay = self.backoff_max_s
                else:
                    log.warning("enrolment at %s failed: %s", addr, details)
                    self.enrol_endpoints.failed(exc)
            except ValueError as exc:  # the certificate we got does not fit
                log.error("the certificate from %s is unusable: %s", addr, exc)
                delay = self.backoff_max_s
            if not delay:
                delay = backoff
                backoff = min(self.backoff_max_s, backoff * 2)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), delay * random.uniform(0.8, 1.0))
        return False

    async def renew_forever(self, stopping: asyncio.Event) -> None:
        """Renew at two thirds of each certificate's lifetime, until `stopping`."""
        backoff = BACKOFF_INITIAL_S
        while not stopping.is_set():
            assert self.issued is not None
            now = dt.datetime.now(dt.UTC)
            if now >= self.issued.not_after:  # renewal came too late: enrol again
                log.error("the certificate of %s expired at %s before it could be renewed; "
                          "enrolling again with the bootstrap token", self.identity.host,
                          self.issued.not_after.isoformat(timespec="seconds"))
                try:
                    if not await self.ensure(stopping):
                        return
                except ConfigError as exc:
                    log.error("%s", exc.message)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stopping.wait(), self.backoff_max_s)
                continue
            wait_s = (self.issued.renew_at() - now).total_seconds()
            if wait_s > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), wait_s)
                continue
            try:
                await self.renew_once()
                backoff = BACKOFF_INITIAL_S
            except (grpc.RpcError, ValueError, OSError) as exc:
                details = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)  # type: ignore[attr-defined]
                left = (self.issued.not_after - dt.datetime.now(dt.UTC)).total_seconds()
                log.warning("certificate renewal failed (%s); %.0fs of validity left, "
                            "retrying", details, left)
                delay = min(backoff, max(0.5, left / 4))
                backoff = min(self.backoff_max_s, backoff * 2)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), delay)

    async def renew_once(self) -> Issued:
        """A new key and its certificate, asked over mutual TLS with the current one."""
        from gearshift.v1 import enrol_pb2, enrol_pb2_grpc
        key = new_key()
        csr = make_csr(self.identity.host, key)
        addr = self.controllers.current
        async with secure_channel(addr, self.identity.tls_files()) as ch:
            resp = await enrol_pb2_grpc.EnrolServiceStub(ch).Renew(
                enrol_pb2.RenewRequest(csr_pem=csr), timeout=RPC_TIMEOUT_S)
        self.issued = self.identity.save(resp.certificate_pem, key)
        self.renewals += 1
        log.info("certificate renewed at %s: valid until %s (the open stream carries on; "
                 "the next connection uses it)", addr,
                 self.issued.not_after.isoformat(timespec="seconds"))
        return self.issued


__all__ = ["BOOTSTRAP_TOKEN_ENV", "BOOTSTRAP_TOKEN_FILE_ENV", "RENEW_AT_FRACTION", "Enroller",
           "Identity", "Issued", "load_bootstrap_token", "make_csr", "new_key"]
