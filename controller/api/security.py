"""Server-side security: TLS credentials, bearer tokens with roles, agent identity.

- `server_credentials` loads the controller's certificate and key; with
  `require_client_cert=True` every client must present a certificate signed by
  the CA (mutual TLS). Agents authenticate only that way; the gateway and the CLI
  present their client certificates too and add a bearer token.
- `TokenStore` holds bearer tokens per role, loaded from a file or an
  environment variable, never from the command line. Tokens are compared with
  `hmac.compare_digest` and never logged: logs name the role and a short SHA-256
  prefix (`token_fingerprint`).
- `AuthInterceptor` (grpc.aio) decides every call by its caller's identity against
  `METHOD_RULES` BEFORE the handler runs, so a refused call has no side effect.
  Identities: an agent host's certificate (its stream and its renewal only), a
  gateway's certificate (the routing table and its reports only), and people: the
  role `read` (listing, showing, explaining) or `admin` (changing things; implies
  read), from a bearer token where the controller has tokens, else from the
  certificate (`spiffe://gearshift/role/<role>`). An agent's or a gateway's
  certificate never acts as a person, whatever token it sends. Unknown methods need
  admin (fail closed). The table is in docs/security.md.
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
from gearshift.common.identity import (
    AUTHORIZATION_HEADER,
    BEARER_PREFIX,
    GATEWAY_URI,
    HOST_URI_PREFIX,
    LEGACY_CLI_URI,
    ROLE_URI_PREFIX,
    SPIFFE_TRUST_DOMAIN,
)

log = logging.getLogger(__name__)

CONTROL_SERVICE = "/gearshift.v1.ControlService/"
AGENT_SERVICE = "/gearshift.v1.AgentService/"
ENROL_SERVICE = "/gearshift.v1.EnrolService/"
SPIFFE_PREFIX = f"spiffe://{SPIFFE_TRUST_DOMAIN}/"
TOKEN_MIN_CHARS = 16
FINGERPRINT_HEX_CHARS = 8


class Role(StrEnum):
    """Who a caller is, by its certificate or its bearer token (docs/security.md)."""

    READ = "read"        # a person: list, show, explain
    ADMIN = "admin"      # a person: apply, approve, reject, pause, abort, publish, evaluate
    AGENT = "agent"      # an agent host's certificate: its stream and its renewal, nothing else
    GATEWAY = "gateway"  # a gateway's certificate: the routing table and its reports


PEOPLE = frozenset({Role.READ, Role.ADMIN})
_READERS = PEOPLE  # admin implies read: every rule a reader passes, an admin passes
_READ_METHODS = (
    "FleetStatus", "ListHosts", "ListDeployments", "ListModels",
    "ValidatePolicy", "GetPolicy", "PolicyHistory", "ListDecisions", "GetDecision",
    "ListMigrations", "GetMigration", "GetCapacity", "GetRateHistory", "ControllerStatus",
    "ListEnrolments",
)
_ADMIN_METHODS = (
    "ApplyPolicy", "ApproveDecision", "RejectDecision", "EvaluateNow", "SetPaused",
    "AbortMigration", "PublishRevision",
    "CreateBootstrapToken", "ListBootstrapTokens", "RevokeBootstrapToken", "ApproveHost",
    "RevokeHost", "ResetHost",
)
# Every RPC of every service the controller serves -> the roles that may call it; None:
# anyone (health, reflection; Enrol carries its own bootstrap token). A method without a
# rule is refused to all but admins (fail closed), and the descriptor-driven test
# (tests/unit/controller/test_authorization.py) fails until it has one.
METHOD_RULES: dict[str, frozenset[Role] | None] = {
    **{CONTROL_SERVICE + m: _READERS for m in _READ_METHODS},
    **{CONTROL_SERVICE + m: frozenset({Role.ADMIN}) for m in _ADMIN_METHODS},
    CONTROL_SERVICE + "WatchRoutes": frozenset({Role.GATEWAY, *_READERS}),
    CONTROL_SERVICE + "ReportGateway": frozenset({Role.GATEWAY}),
    AGENT_SERVICE + "Connect": frozenset({Role.AGENT}),
    ENROL_SERVICE + "Renew": frozenset({Role.AGENT}),
    ENROL_SERVICE + "Enrol": None,
    "/grpc.health.v1.Health/Check": None,
    "/grpc.health.v1.Health/Watch": None,
    "/grpc.health.v1.Health/List": None,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": None,
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": None,
}
MACHINES = frozenset({Role.AGENT, Role.GATEWAY})
_FAIL_CLOSED = frozenset({Role.ADMIN})


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
    """Refuse a call its caller may not make, before its handler runs (docs/security.md).

    The caller is its verified certificate's identity (`certificate_role`: an agent
    host, a gateway, or a person with the read or admin role) and, for people, its
    bearer token where the controller has tokens. Agent and gateway certificates may
    call their own RPCs only, whatever token they send. A person's role is the token's
    where tokens are configured (a missing token -> UNAUTHENTICATED "missing bearer
    token"), else the certificate's. Refusals: UNAUTHENTICATED (no credential, or an
    unknown token), PERMISSION_DENIED naming the role and what the RPC needs.

    `require_identity` (TLS with client certificates): a call without a certificate
    role is no agent or gateway, and without tokens nobody at all. Without it (a
    plaintext controller on loopback, for development) a caller without credentials
    may call anything. Put it FIRST in the server's interceptor list.
    """

    def __init__(self, tokens: TokenStore | None,
                 rules: Mapping[str, frozenset[Role] | None] | None = None, *,
                 require_identity: bool = False) -> None:
        self.tokens = tokens
        self.rules = dict(METHOD_RULES if rules is None else rules)
        self.require_identity = require_identity

    def allowed(self, method: str) -> frozenset[Role] | None:
        return self.rules.get(method, _FAIL_CLOSED)

    def check(self, method: str, metadata: Iterable[tuple[str, Any]] | None,
              cert_role: Role | None = None) -> tuple[grpc.StatusCode, str] | None:
        """None when the call may go on, else the status and details to refuse it with."""
        allowed = self.allowed(method)
        if allowed is None:
            return None
        short = method.rsplit("/", 1)[-1]
        if cert_role in MACHINES:
            if cert_role in allowed:
                return None
            whose = "an agent's" if cert_role is Role.AGENT else "a gateway's"
            log.warning("refused %s: %s certificate", short, whose)
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{whose} certificate cannot call {short} (needs {_names(allowed)})")
        if allowed <= MACHINES:  # an agent's or a gateway's own RPC
            if not self.require_identity:
                return None  # plaintext development: agents and gateways have no certificate
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{short} needs a certificate of role {_names(allowed)}")
        role: Role | None = cert_role
        if self.tokens is not None:
            token = bearer_token(metadata)
            if token is None:
                log.warning("refused %s: missing bearer token", short)
                return grpc.StatusCode.UNAUTHENTICATED, "missing bearer token"
            principal = self.tokens.authenticate(token)
            if principal is None:
                log.warning("refused %s: invalid token %s", short, token_fingerprint(token))
                return grpc.StatusCode.UNAUTHENTICATED, "invalid token"
            role, who = principal.role, f"token {principal.fingerprint}"
        elif role is None:
            if not self.require_identity:
                return None  # plaintext development on loopback
            return (grpc.StatusCode.UNAUTHENTICATED,
                    "no credential: a certificate of role read or admin, or a bearer token")
        else:
            who = "certificate"
        if role not in allowed:
            log.warning("refused %s: role %s (%s)", short, role.value, who)
            need = "admin" if allowed == _FAIL_CLOSED else _names(allowed - MACHINES)
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"role {role.value} cannot call {short} (needs {need})")
        if allowed == _FAIL_CLOSED:
            log.info("%s by role %s (%s)", short, role.value, who)
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        metadata = handler_call_details.invocation_metadata
        if self.allowed(method) is None:
            return handler
        if not self.require_identity:  # no certificates: decide now, as before
            refusal = self.check(method, metadata)
            return handler if refusal is None else denying_handler(handler, *refusal)
        return guarded_handler(handler, lambda ctx: self.check(
            method, metadata, certificate_role(ctx)))


def _names(roles: Iterable[Role]) -> str:
    return " or ".join(sorted(r.value for r in roles))


def guarded_handler(handler: grpc.RpcMethodHandler,
                    check: Callable[[Any], tuple[grpc.StatusCode, str] | None]
                    ) -> grpc.RpcMethodHandler:
    """`handler` behind `check(context)`: the certificate is known only once the call
    runs, so the check is made there, before the real behaviour starts."""
    ser = {"request_deserializer": handler.request_deserializer,
           "response_serializer": handler.response_serializer}

    async def unary(request: Any, context: aio.ServicerContext) -> Any:
        refusal = check(context)
        if refusal is not None:
            await context.abort(*refusal)
        behaviour = handler.unary_unary or handler.stream_unary
        return await behaviour(request, context)

    async def streaming(request: Any, context: aio.ServicerContext) -> Any:
        refusal = check(context)
        if refusal is not None:
            await context.abort(*refusal)
        behaviour = handler.unary_stream or handler.stream_stream
        result = behaviour(request, context)
        if hasattr(result, "__aiter__"):
            async for item in result:
                yield item
        else:  # a coroutine that writes through the context
            await result

    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary, **ser)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary, **ser)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming, **ser)
    return grpc.stream_stream_rpc_method_handler(streaming, **ser)


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


def certificate_role(context: Any) -> Role | None:
    """The role the peer's verified client certificate names, or None: an agent host
    (`spiffe://gearshift/host/<host>`), a gateway (`spiffe://gearshift/gateway`), a
    person (`spiffe://gearshift/role/read|admin`; the older `spiffe://gearshift/cli`
    counts as read). A certificate with several gearshift URIs names none."""
    if "ssl" not in _auth_values(context, "transport_security_type"):
        return None
    uris = {san for key in ("peer_uri", "x509_subject_alternative_name", "peer_spiffe_id")
            for san in _auth_values(context, key) if san.startswith(SPIFFE_PREFIX)}
    if len(uris) != 1:
        return None
    uri = uris.pop()
    if uri.startswith(HOST_URI_PREFIX) and len(uri) > len(HOST_URI_PREFIX):
        return Role.AGENT
    if uri == GATEWAY_URI:
        return Role.GATEWAY
    if uri == LEGACY_CLI_URI:
        return Role.READ
    if uri.startswith(ROLE_URI_PREFIX):
        name = uri[len(ROLE_URI_PREFIX):]
        if name in (Role.READ.value, Role.ADMIN.value):
            return Role(name)
    return None


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
