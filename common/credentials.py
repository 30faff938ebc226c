"""Client-side security for every gRPC client (CLI, agent, gateway): TLS files and tokens.

`secure_channel(addr, tls, token)` is the one way to open a channel to the
controller. With `tls` it verifies the controller against the CA and, when a
client certificate is given, presents it (mutual TLS); the token rides as
`authorization: Bearer …` call credentials, which gRPC sends only over TLS.
Without `tls` it opens PLAINTEXT only to a loopback address, with a loud warning,
and refuses any other address; a token then goes as call metadata through a
small client interceptor (gRPC refuses call credentials on insecure channels).

Secrets come from files or environment variables, never from the command line:
`load_token(path)` / `$GEARSHIFT_TOKEN` / `$GEARSHIFT_TOKEN_FILE`, and
`TlsFiles.from_env()` reads `$GEARSHIFT_TLS_CA`, `_CERT`, `_KEY`.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc import aio as grpc_aio

from gearshift.common.errors import ConfigError
from gearshift.common.identity import (
    AUTHORIZATION_HEADER,
    TLS_ENV_PREFIX,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
)

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class TlsFiles:
    """PEM files of one TLS client: the CA to trust and, for mutual TLS, a certificate and key."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None  # name to verify instead of the address's host

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("--tls-cert and --tls-key: give both or neither")

    @classmethod
    def from_dir(cls, directory: Path | str, name: str, *,
                 server_name: str | None = None) -> TlsFiles:
        """`ca.pem`, `<name>.pem`, `<name>-key.pem` in `directory`, as `certs init` writes them."""
        d = Path(directory)
        return cls(d / "ca.pem", d / f"{name}.pem", d / f"{name}-key.pem", server_name)

    @classmethod
    def from_env(cls, prefix: str = TLS_ENV_PREFIX,
                 environ: Mapping[str, str] | None = None) -> TlsFiles | None:
        """`$<prefix>_CA`, `_CERT`, `_KEY`, `_SERVER_NAME`; None when no CA is set."""
        env = os.environ if environ is None else environ
        ca = env.get(f"{prefix}_CA")
        if not ca:
            if env.get(f"{prefix}_CERT") or env.get(f"{prefix}_KEY"):
                raise ConfigError(f"${prefix}_CERT/_KEY set without ${prefix}_CA")
            return None
        cert, key = env.get(f"{prefix}_CERT"), env.get(f"{prefix}_KEY")
        return cls(Path(ca), Path(cert) if cert else None, Path(key) if key else None,
                   env.get(f"{prefix}_SERVER_NAME") or None)


def _read(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{what} {path}: not a PEM file")
    return data


def channel_credentials(ca: Path | str, cert: Path | str | None = None,
                        key: Path | str | None = None) -> grpc.ChannelCredentials:
    """TLS channel credentials trusting `ca`; with `cert` and `key`, mutual TLS."""
    if (cert is None) != (key is None):
        raise ConfigError("--tls-cert and --tls-key: give both or neither")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(Path(ca), "--tls-ca"),
        private_key=_read(Path(key), "--tls-key") if key is not None else None,
        certificate_chain=_read(Path(cert), "--tls-cert") if cert is not None else None)


def token_call_credentials(token: str) -> grpc.CallCredentials:
    """`authorization: Bearer <token>` on every call (gRPC sends it only over TLS)."""
    return grpc.access_token_call_credentials(token)


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The same header as call metadata, for one call: `stub.X(req, metadata=...)`."""
    return ((AUTHORIZATION_HEADER, f"Bearer {token}"),)


def load_token(path: Path | str | None = None, *,
               environ: Mapping[str, str] | None = None) -> str | None:
    """A bearer token from `path`, else `$GEARSHIFT_TOKEN_FILE`, else `$GEARSHIFT_TOKEN`."""
    env = os.environ if environ is None else environ
    source = str(path) if path is not None else env.get(TOKEN_FILE_ENV)
    if source:
        try:
            token = Path(source).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"token file {source}: cannot read: {exc.strerror or exc}") from None
        if not token or any(c.isspace() for c in token):
            raise ConfigError(f"token file {source}: expected one token on one line")
        return token
    token = env.get(TOKEN_ENV, "").strip()
    return token or None


def address_host(addr: str) -> str:
    """The host part of `host:port`, `[v6]:port` or `ipv4:host:port`."""
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if addr.startswith(scheme):
            addr = addr[len(scheme):]
            break
    host = addr.rsplit(":", 1)[0] if addr.count(":") == 1 or addr.startswith("[") else addr
    return host.strip("[]")


def is_loopback_address(addr: str) -> bool:
    """True for 127.0.0.0/8, ::1, `localhost` and unix sockets."""
    if addr.startswith(("unix:", "unix-abstract:")):
        return True
    host = address_host(addr)
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


CLIENT_TLS_HINT = "give a CA (--tls-ca or $GEARSHIFT_TLS_CA) and a client certificate"


def check_plaintext(addr: str, *, role: str = "gRPC to", hint: str = CLIENT_TLS_HINT) -> None:
    """Warn loudly for plaintext on loopback; refuse it anywhere else."""
    if not is_loopback_address(addr):
        raise ConfigError(
            f"plaintext {role} {addr} refused: only loopback addresses may go without TLS; "
            f"{hint}")
    if role == "gRPC to":  # a client: loud once per address, not at every reconnect
        if addr in _WARNED:
            return
        _WARNED.add(addr)
    log.warning("PLAINTEXT %s %s: for loopback development only (no TLS, no client "
                "certificate, tokens travel unencrypted)", role, addr)


_WARNED: set[str] = set()


class _MetadataAdder:
    """Adds one metadata entry to every call: plaintext channels cannot carry call credentials."""

    def __init__(self, key: str, value: str) -> None:
        self._entry = (key, value)

    def _details(self, details: Any, factory: Callable[..., Any]) -> Any:
        metadata = list(details.metadata or ())
        metadata.append(self._entry)
        return factory(details, metadata)


def _sync_details(details: Any, metadata: list[tuple[str, str]]) -> Any:
    return _SyncDetails(details.method, details.timeout, metadata, details.credentials,
                        getattr(details, "wait_for_ready", None),
                        getattr(details, "compression", None))


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(self, method: str, timeout: float | None, metadata: Any, credentials: Any,
                 wait_for_ready: bool | None, compression: Any) -> None:
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


class _SyncTokenInterceptor(_MetadataAdder, grpc.UnaryUnaryClientInterceptor,
                            grpc.UnaryStreamClientInterceptor, grpc.StreamUnaryClientInterceptor,
                            grpc.StreamStreamClientInterceptor):
    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details, _sync_details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details, _sync_details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, it: Any) -> Any:
        return continuation(self._details(details, _sync_details), it)

    def intercept_stream_stream(self, continuation: Any, details: Any, it: Any) -> Any:
        return continuation(self._details(details, _sync_details), it)


def _aio_details(details: Any, metadata: list[tuple[str, str]]) -> Any:
    return grpc_aio.ClientCallDetails(details.method, details.timeout, grpc_aio.Metadata(*metadata),
                                 details.credentials, details.wait_for_ready)


class _AioUnaryUnary(_MetadataAdder, grpc_aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details, _aio_details), request)


class _AioUnaryStream(_MetadataAdder, grpc_aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details, _aio_details), request)


class _AioStreamUnary(_MetadataAdder, grpc_aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, it: Any) -> Any:
        return await continuation(self._details(details, _aio_details), it)


class _AioStreamStream(_MetadataAdder, grpc_aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, it: Any) -> Any:
        return await continuation(self._details(details, _aio_details), it)


def secure_channel(addr: str, tls: TlsFiles | None, token: str | None = None, *,
                   aio: bool = True,
                   options: list[tuple[str, Any]] | None = None) -> Any:
    """Open a channel to `addr`: a `grpc.aio.Channel` (`aio=True`) or a blocking `grpc.Channel`.

    TLS when `tls` is given; plaintext only to loopback, with a loud warning
    (`ConfigError` for any other address). `token`, when given, goes with every call.
    """
    opts = list(options or [])
    if tls is not None:
        creds = channel_credentials(tls.ca, tls.cert, tls.key)
        if token:
            creds = grpc.composite_channel_credentials(creds, token_call_credentials(token))
        if tls.server_name:
            opts.append(("grpc.ssl_target_name_override", tls.server_name))
        if aio:
            return grpc_aio.secure_channel(addr, creds, options=opts)
        return grpc.secure_channel(addr, creds, options=opts)
    check_plaintext(addr)
    header = (AUTHORIZATION_HEADER, f"Bearer {token}")
    if aio:
        interceptors: list[Any] = [] if not token else [
            cls(*header) for cls in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary,
                                     _AioStreamStream)]
        return grpc_aio.insecure_channel(addr, options=opts, interceptors=interceptors or None)
    channel = grpc.insecure_channel(addr, options=opts)
    return grpc.intercept_channel(channel, _SyncTokenInterceptor(*header)) if token else channel
