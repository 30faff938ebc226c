"""Server-side security: TLS credentials, bearer tokens with roles, agent identity.

- `server_credentials` loads the controller's certificate and key; with
  `require_client_cert=True` every client must present a certificate signed by
  the CA (mutual TLS). Agents authenticate only that way; the gateway and the CLI
  present their client certificates too and add a bearer token.
- `TokenStore` holds bearer tokens per role, loaded from a file or an
  environment variable, never from the command line. Tokens are compared with
  `hmac.compare_digest` and never logged: logs name the role and a short SHA-256
  prefix (`token_fingerprint`).
- `AuthInterceptor` (grpc.aio) checks `authorization: Bearer <token>` against
  `METHOD_ROLES` BEFORE the handler runs, so a refused call has no side effect.
  Roles: `read` (listing, showing, explaining) and `admin` (changing things);
  admin implies read. `WatchRoutes` and `ReportGateway` need `read`: the gateway
  runs with a read token, because it only follows the routing table and reports
  what its clients saw (counters the controller folds into its own view; they can
  approve, apply or abort nothing). Unknown methods of ControlService need admin
  (fail closed); AgentService, health and reflection are exempt from tokens.
- `peer_host_id` returns the host that a verified agent certificate names: the
  URI SAN `spiffe://gearshift/host/<host>` only (never the CN), so that
  `check_peer_host` can refuse a Hello or Report for another host.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc import aio

from gearshift.common.credentials import check_plaintext
from gearshift.common.errors import ConfigError, PermissionDenied
from gearshift.common.identity import AUTHORIZATION_HEADER, BEARER_PREFIX, HOST_URI_PREFIX

log = logging.getLogger(__name__)

CONTROL_SERVICE = "/gearshift.v1.ControlService/"
AGENT_SERVICE = "/gearshift.v1.AgentService/"
ENROL_SERVICE = "/gearshift.v1.EnrolService/"
TOKEN_MIN_CHARS = 16
FINGERPRINT_HEX_CHARS = 8


class Role(StrEnum):
    READ = "read"    # list, show, explain; the gateway's routes and reports
    ADMIN = "admin"  # apply, approve, reject, pause, abort, publish, evaluate; implies read


_READ_METHODS = (
    "FleetStatus", "ListHosts", "ListDeployments", "ListModels", "WatchRoutes", "ReportGateway",
    "ValidatePolicy", "GetPolicy", "PolicyHistory", "ListDecisions", "GetDecision",
    "ListMigrations", "GetMigration", "GetCapacity", "GetRateHistory", "ControllerStatus",
    "ListEnrolments",
)
_ADMIN_METHODS = (
    "ApplyPolicy", "ApproveDecision", "RejectDecision", "EvaluateNow", "SetPaused",
    "AbortMigration", "PublishRevision",
    "CreateBootstrapToken", "ListBootstrapTokens", "RevokeBootstrapToken", "ApproveHost",
    "RevokeHost",
)
# Full gRPC method name -> the role it needs. None: no token checked (mTLS or public).
METHOD_ROLES: dict[str, Role | None] = {
    **{CONTROL_SERVICE + m: Role.READ for m in _READ_METHODS},
    **{CONTROL_SERVICE + m: Role.ADMIN for m in _ADMIN_METHODS},
    AGENT_SERVICE + "Connect": None,
}
# Prefixes that never need a token: agents (mTLS), enrolment (a bootstrap token in the
# request, or the agent's certificate), health checks, reflection (grpcurl).
EXEMPT_PREFIXES: tuple[str, ...] = (
    AGENT_SERVICE, ENROL_SERVICE, "/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)


def _read_file(path: Path | str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read: {exc.strerror or exc}") from None


def server_credentials(cert: Path | str, key: Path | str, ca: Path | str | None = None,
                       require_client_cert: bool = True) -> grpc.ServerCredentials:
    """TLS credentials for the controller; with `require_client_cert`, mutual TLS against `ca`."""
    if require_client_cert and ca is None:
        raise ConfigError("--tls-ca: a CA is needed to verify client certificates (mutual TLS)")
    cert_pem, key_pem = _read_file(cert, "--tls-cert"), _read_file(key, "--tls-key")
    if b"-----BEGIN CERTIFICATE-----" not in cert_pem:
        raise ConfigError(f"--tls-cert {cert}: not a PEM certificate")
    if b"PRIVATE KEY-----" not in key_pem:
        raise ConfigError(f"--tls-key {key}: not a PEM private key")
    ca_pem = _read_file(ca, "--tls-ca") if ca is not None else None
    if ca_pem is not None and b"-----BEGIN CERTIFICATE-----" not in ca_pem:
        raise ConfigError(f"--tls-ca {ca}: not a PEM certificate")
    return grpc.ssl_server_credentials(
        [(key_pem, cert_pem)], root_certificates=ca_pem, require_client_auth=require_client_cert)


def check_plaintext_listen(listen: str) -> None:
    """For a controller started without TLS: warn loudly on loopback, refuse elsewhere."""
    check_plaintext(listen, role="gRPC listening on",
                    hint="give --tls-cert, --tls-key and --tls-ca (see `gearshift certs init`)")


def token_fingerprint(token: str) -> str:
    """A short, non-reversible tag for logs: the first hex digits of SHA-256."""
    return hashlib.sha256(token.encode()).hexdigest()[:FINGERPRINT_HEX_CHARS]


@dataclass(frozen=True)
class Principal:
    """Who made a call: the role of the token and its fingerprint (never the token)."""

    role: Role
    fingerprint: str


class TokenStore:
    """Bearer tokens per role. Build with `from_file`, `from_env` or `from_mapping`."""

    def __init__(self, tokens: Iterable[tuple[Role, str]]) -> None:
        self._tokens = [(role, tok.encode()) for role, tok in tokens]
        if not self._tokens:
            raise ConfigError("token store: no tokens given")

    def __repr__(self) -> str:  # never print the tokens themselves
        roles = sorted({r.value for r, _ in self._tokens})
        return f"TokenStore({len(self._tokens)} tokens, roles={roles})"

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str = "tokens") -> TokenStore:
        """`{"admin": "tok" | ["tok", ...], "read": ...}`; unknown roles are errors."""
        pairs: list[tuple[Role, str]] = []
        for key, value in data.items():
            try:
                role = Role(str(key).strip())
            except ValueError:
                raise ConfigError(
                    f"{where}: unknown role {key!r}; known roles: admin, read") from None
            values = value if isinstance(value, list) else [value]
            for i, tok in enumerate(values):
                pairs.append((role, _check_token(tok, f"{where}: {role.value}[{i}]")))
        return cls(pairs)

    @classmethod
    def parse(cls, text: str, where: str) -> TokenStore:
        """YAML (`role: token` or `role: [tokens]`) or plain `role:token` lines."""
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            data = None
        if not isinstance(data, dict):
            data = {}
            for n, line in enumerate(text.splitlines(), start=1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                role, sep, tok = line.partition(":")
                if not sep:
                    raise ConfigError(f"{where}:{n}: expected 'role: token', found no ':'")
                data.setdefault(role.strip(), []).append(tok.strip())
        return cls.from_mapping(data, where)

    @classmethod
    def from_file(cls, path: Path | str) -> TokenStore:
        store = cls.parse(_read_file(path, "token file").decode(errors="replace"), str(path))
        log.info("loaded bearer tokens from %s: %s", path, store.describe())
        return store

    @classmethod
    def from_env(cls, var: str = "GEARSHIFT_TOKENS") -> TokenStore:
        """Tokens from an environment variable, e.g. `admin:TOK1,read:TOK2` or YAML."""
        text = os.environ.get(var)
        if not text:
            raise ConfigError(f"${var}: not set (expected 'admin:TOKEN,read:TOKEN')")
        lines = text.replace(",", "\n") if "\n" not in text and "{" not in text else text
        store = cls.parse(lines, f"${var}")
        log.info("loaded bearer tokens from $%s: %s", var, store.describe())
        return store

    def describe(self) -> str:
        """Roles and fingerprints, safe to log."""
        return ", ".join(f"{role.value}={token_fingerprint(tok.decode())}"
                         for role, tok in self._tokens)

    def authenticate(self, token: str) -> Principal | None:
        """The principal of `token`, or None. Compares every entry in constant time."""
        given = token.encode()
        found: Role | None = None
        for role, tok in self._tokens:
            if hmac.compare_digest(given, tok) and (found is None or role == Role.ADMIN):
                found = role
        return Principal(found, token_fingerprint(token)) if found is not None else None


def _check_token(tok: Any, where: str) -> str:
    if not isinstance(tok, str) or not tok.strip():
        raise ConfigError(f"{where}: expected a non-empty token string")
    tok = tok.strip()
    if len(tok) < TOKEN_MIN_CHARS or any(c.isspace() for c in tok):
        raise ConfigError(
            f"{where}: a token needs at least {TOKEN_MIN_CHARS} characters and no spaces")
    return tok


def role_allows(have: Role, need: Role) -> bool:
    return have == Role.ADMIN or have == need


def bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The token of the `authorization: Bearer <token>` metadata entry, if any."""
    for key, value in metadata or ():
        if key.lower() != AUTHORIZATION_HEADER:
            continue
        text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
        if text[:len(BEARER_PREFIX)].lower() == BEARER_PREFIX:
            return text[len(BEARER_PREFIX):].strip() or None
    return None


def denying_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str,
                    trailing_metadata: tuple[tuple[str, str], ...] = ()) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts at once (the real one never runs)."""

    async def deny(request: Any, context: aio.ServicerContext) -> Any:
        await context.abort(code, details, trailing_metadata)

    async def deny_stream(request: Any, context: aio.ServicerContext) -> Any:
        await context.abort(code, details, trailing_metadata)
        yield  # pragma: no cover - makes this an async generator

    ser = {"request_deserializer": handler.request_deserializer,
           "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(deny, **ser)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **ser)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(deny, **ser)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **ser)


class AuthInterceptor(aio.ServerInterceptor):
    """Refuse calls without a valid bearer token of the needed role, before any handler runs.

    Missing token -> UNAUTHENTICATED "missing bearer token"; unknown token ->
    UNAUTHENTICATED "invalid token"; too weak a role -> PERMISSION_DENIED
    "role read cannot call ApplyPolicy (needs admin)". Put it FIRST in the
    server's interceptor list so that it wraps everything else.
    """

    def __init__(self, tokens: TokenStore,
                 method_roles: Mapping[str, Role | None] | None = None,
                 exempt_prefixes: Iterable[str] = EXEMPT_PREFIXES) -> None:
        self.tokens = tokens
        self.method_roles = dict(METHOD_ROLES if method_roles is None else method_roles)
        self.exempt_prefixes = tuple(exempt_prefixes)

    def required_role(self, method: str) -> Role | None:
        if method in self.method_roles:
            return self.method_roles[method]
        if method.startswith(self.exempt_prefixes):
            return None
        return Role.ADMIN  # fail closed: a method nobody classified needs the strongest role

    def check(self, method: str, metadata: Iterable[tuple[str, Any]] | None,
              ) -> tuple[grpc.StatusCode, str] | None:
        """None when the call may go on, else the status and details to refuse it with."""
        need = self.required_role(method)
        if need is None:
            return None
        short = method.rsplit("/", 1)[-1]
        token = bearer_token(metadata)
        if token is None:
            log.warning("refused %s: missing bearer token", short)
            return grpc.StatusCode.UNAUTHENTICATED, "missing bearer token"
        principal = self.tokens.authenticate(token)
        if principal is None:
            log.warning("refused %s: invalid token %s", short, token_fingerprint(token))
            return grpc.StatusCode.UNAUTHENTICATED, "invalid token"
        if not role_allows(principal.role, need):
            log.warning("refused %s: role %s (token %s)", short, principal.role.value,
                        principal.fingerprint)
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"role {principal.role.value} cannot call {short} (needs {need.value})")
        if need == Role.ADMIN:
            log.info("%s by role %s (token %s)", short, principal.role.value,
                     principal.fingerprint)
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        refusal = self.check(handler_call_details.method,
                             handler_call_details.invocation_metadata)
        if refusal is None:
            return handler
        return denying_handler(handler, *refusal)


def _auth_values(context: Any, key: str) -> list[str]:
    try:
        auth = context.auth_context()
    except (AttributeError, RuntimeError):
        return []
    return [v.decode(errors="replace") if isinstance(v, bytes) else str(v)
            for v in (auth or {}).get(key, [])]


def peer_host_id(context: Any) -> str | None:
    """The host named by the peer's verified client certificate, or None.

    Only a URI SAN `spiffe://gearshift/host/<host>` counts (the CN does not), and
    only on a TLS connection. Without `require_client_cert=True` on the server,
    there is no verified client certificate and this returns None.
    """
    if "ssl" not in _auth_values(context, "transport_security_type"):
        return None
    hosts = {san[len(HOST_URI_PREFIX):]
             for key in ("peer_uri", "x509_subject_alternative_name", "peer_spiffe_id")
             for san in _auth_values(context, key) if san.startswith(HOST_URI_PREFIX)}
    if len(hosts) != 1:
        return None  # none, or a certificate naming several hosts: trust neither
    return hosts.pop() or None


def check_peer_host(context: Any, host_id: str, *, require: bool = True) -> None:
    """Raise PermissionDenied unless the peer's certificate names `host_id`.

    `require=False` (plaintext loopback development) lets a peer without a
    certificate through; a certificate that names another host is refused anyway.
    """
    named = peer_host_id(context)
    if named is None:
        if require:
            raise PermissionDenied(
                f"no client certificate naming a host ({HOST_URI_PREFIX}<host>); "
                f"hello says {host_id}")
        return
    if named != host_id:
        raise PermissionDenied(f"certificate names {named}, hello says {host_id}")
