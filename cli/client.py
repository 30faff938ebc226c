"""The CLI's connection to the controller, and the one mapping of errors to exits."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import click
import grpc

from gearshift.common.credentials import TlsFiles, load_token, secure_channel
from gearshift.common.endpoints import ControllerEndpoints
from gearshift.common.errors import ErrorCode, GearshiftError, Unavailable, error_for
from gearshift.common.identity import TLS_ENV_PREFIX, TOKEN_ENV, TOKEN_FILE_ENV
from gearshift.v1 import control_pb2_grpc

DEFAULT_CONTROLLER = "127.0.0.1:50051"
RPC_TIMEOUT_S = 10.0
# A controller answers a connection at once; a port that accepts and then stays
# silent (not a gRPC server, a hung process) fails after this, like a refused port.
CONNECT_TIMEOUT_S = 5.0
_SETTLED = (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE,
            grpc.ChannelConnectivity.SHUTDOWN)
try:  # gRPC core's connectivity states as the public enum (grpc._common, as gRPC reads them)
    from grpc._common import CYGRPC_CONNECTIVITY_STATE_TO_CHANNEL_CONNECTIVITY as _CORE_STATES
except ImportError:
    _CORE_STATES = None

T = TypeVar("T")


class CliError(click.ClickException):
    """A gearshift error shown to a person: message only, exit code by status."""

    EXIT_BY_CODE: ClassVar[dict[ErrorCode, int]] = {
        ErrorCode.INVALID_ARGUMENT: 2,
        ErrorCode.NOT_FOUND: 3,
        ErrorCode.FAILED_PRECONDITION: 4,
        ErrorCode.UNAVAILABLE: 5,
        ErrorCode.PERMISSION_DENIED: 6,
        ErrorCode.UNAUTHENTICATED: 6,
    }

    def __init__(self, err: GearshiftError) -> None:
        super().__init__(err.message)
        self.exit_code = self.EXIT_BY_CODE.get(err.code, 1)  # type: ignore[misc]


@dataclass(frozen=True)
class ClientSetup:
    """What the CLI connected with, for the hint an error gets: the address and the TLS
    files ($GEARSHIFT_TLS_*; None: plaintext)."""

    addr: str
    tls: TlsFiles | None


_CA, _CERT, _KEY = (f"${TLS_ENV_PREFIX}_CA", f"${TLS_ENV_PREFIX}_CERT", f"${TLS_ENV_PREFIX}_KEY")
_TOKEN_VARS = f"${TOKEN_FILE_ENV} (a file holding the token) or ${TOKEN_ENV}"
# gRPC core's words for each failure (its details, and OpenSSL's reason codes within them).
_REFUSED = ("Connection refused", "connection refused", "ECONNREFUSED")
_NOT_VERIFIED = ("CERTIFICATE_VERIFY_FAILED", "certificate verify failed")
_NAME_MISMATCH = ("Peer name", "not in peer certificate", "Hostname Verification")
_NOT_TLS = ("WRONG_VERSION_NUMBER", "wrong version number")
_CLOSED = ("Socket closed", "Connection reset", "connection reset", "Broken pipe",
           "SSLV3_ALERT", "TLSV1_ALERT")


def connection_hint(code: grpc.StatusCode, details: str, setup: ClientSetup) -> str | None:
    """The likely cause of a failed call, and the flag or variable that fixes it; None
    when the error says nothing about the connection (a refusal of the request itself)."""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        if "invalid token" in details:
            return (f"the controller does not know the token given by {_TOKEN_VARS}: "
                    f"give one from its tokens file (`gearshift certs init` writes "
                    f"read-token and admin-token)")
        return (f"the controller wants a bearer token: set {_TOKEN_VARS} "
                f"(`gearshift certs init` writes read-token and admin-token)")
    if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN):
        return None
    if any(w in details for w in _REFUSED):
        return (f"nothing listens on {setup.addr}: check --controller / $GEARSHIFT_CONTROLLER "
                f"and that the controller runs")
    tls = setup.tls
    if tls is None:
        if any(w in details for w in _CLOSED):
            return (f"the controller closed a plaintext connection: it probably wants TLS. "
                    f"Set {_CA} to the CA that signed its certificate, and {_CERT} and "
                    f"{_KEY} to a client certificate (`gearshift certs init` writes ca.pem, "
                    f"cli.pem, cli-key.pem)")
        return None
    if any(w in details for w in _NOT_VERIFIED):
        return (f"the controller's certificate is not signed by the CA in {_CA} "
                f"({tls.ca}): set {_CA} to the CA that signed it")
    if any(w in details for w in _NAME_MISMATCH):
        named = (f"{tls.server_name} (${TLS_ENV_PREFIX}_SERVER_NAME)" if tls.server_name
                 else f"the host of {setup.addr}")
        return (f"the controller's certificate does not name {named}: connect by a "
                f"name it holds, or set ${TLS_ENV_PREFIX}_SERVER_NAME to one")
    if any(w in details for w in _NOT_TLS):
        return (f"the controller does not speak TLS: unset {_CA}, {_CERT} and {_KEY} "
                f"(plaintext is for loopback only)")
    if any(w in details for w in _CLOSED):
        if tls.cert is None:
            return (f"the controller closed the TLS connection: it probably wants a client "
                    f"certificate (mutual TLS). Set {_CERT} and {_KEY}")
        return (f"the controller refused the client certificate in {_CERT} ({tls.cert}): "
                f"is it signed by the controller's CA, and not expired? Set {_CERT} and "
                f"{_KEY} to a certificate from that CA")
    return None


def from_rpc_error(err: grpc.RpcError, setup: ClientSetup | None = None) -> GearshiftError:
    """Turn a gRPC error received by the CLI back into the matching gearshift error; with
    `setup`, a failed connection or credential also names its likely cause and fix."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    details = details or code.name
    hint = connection_hint(code, details, setup) if setup is not None else None
    if code == grpc.StatusCode.UNAVAILABLE:
        details = f"controller unavailable: {details}"
    if hint:
        details = f"{details}\nhint: {hint}"
    return error_for(code.name, details)


def controller_address(ctx: click.Context) -> str:
    """The --controller / $GEARSHIFT_CONTROLLER value: one HOST:PORT or a comma-separated list."""
    root = ctx.find_root()
    addr = (root.obj or {}).get("controller") if root.obj else None
    return addr or os.environ.get("GEARSHIFT_CONTROLLER") or DEFAULT_CONTROLLER


def controller_endpoints(ctx: click.Context) -> ControllerEndpoints:
    try:
        return ControllerEndpoints(controller_address(ctx))
    except GearshiftError as err:
        raise CliError(err) from None


class FollowingStub:
    """A `ControlServiceStub` over several controllers: a unary call refused by a
    follower is sent again to the leader it names, and one to an unreachable
    controller goes to the next address. Streams use the current controller."""

    def __init__(self, endpoints: ControllerEndpoints,
                 open_channel: Callable[[str], grpc.Channel]) -> None:
        self.endpoints = endpoints
        self._open = open_channel
        self._channels: dict[str, grpc.Channel] = {}

    def _stub(self) -> control_pb2_grpc.ControlServiceStub:
        addr = self.endpoints.current
        if addr not in self._channels:
            channel = self._open(addr)
            try:
                wait_settled(channel, addr, CONNECT_TIMEOUT_S)
            except Unavailable:
                channel.close()
                raise
            self._channels[addr] = channel
        return control_pb2_grpc.ControlServiceStub(self._channels[addr])

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub(), name)
        if not isinstance(method, grpc.UnaryUnaryMultiCallable):
            return method

        def call_following(request: object, **kwargs: Any) -> Any:
            attempts = len(self.endpoints) + 2
            while True:
                try:
                    return getattr(self._stub(), name)(request, **kwargs)
                except grpc.RpcError as err:
                    attempts -= 1
                    code = err.code()  # type: ignore[attr-defined]
                    retry = (code == grpc.StatusCode.UNAVAILABLE and len(self.endpoints) > 1) \
                        or code == grpc.StatusCode.FAILED_PRECONDITION
                    if attempts <= 0 or not retry:
                        raise
                    if not self.endpoints.failed(err) \
                            and code == grpc.StatusCode.FAILED_PRECONDITION:
                        raise  # refused, and no leader named: say so
        return call_following


def wait_settled(channel: grpc.Channel, addr: str, timeout_s: float) -> None:
    """Wait until `channel` is connected or has failed to connect (a refused port:
    the call that follows fails at once with UNAVAILABLE); `Unavailable` when it is
    still connecting after `timeout_s` (the port accepted and never answered).

    The channel's state is watched here, in this thread: `channel.subscribe` would
    start gRPC's polling thread, whose watch runs in 0.2 s steps, and closing the
    channel waits for that step to end (0.2 s added to every command's exit)."""
    core = getattr(channel, "_channel", None)  # gRPC core's channel under grpc.Channel
    if core is not None and not hasattr(core, "check_connectivity_state"):
        core = getattr(core, "_channel", None)  # an intercepted channel (a plaintext token)
    if core is None or not hasattr(core, "check_connectivity_state") or _CORE_STATES is None:
        _wait_subscribed(channel, addr, timeout_s)
        return
    deadline = time.time() + timeout_s
    state = core.check_connectivity_state(True)
    while _CORE_STATES.get(state) not in _SETTLED:
        if time.time() >= deadline:
            raise _silent(addr, timeout_s)
        core.watch_connectivity_state(state, deadline)  # returns at a change or the deadline
        state = core.check_connectivity_state(False)


def _wait_subscribed(channel: grpc.Channel, addr: str, timeout_s: float) -> None:
    """`wait_settled` through the public subscription (a gRPC without a core channel)."""
    settled = threading.Event()

    def on_state(state: grpc.ChannelConnectivity) -> None:
        if state in _SETTLED:
            settled.set()

    channel.subscribe(on_state, try_to_connect=True)
    try:
        if not settled.wait(timeout_s):
            raise _silent(addr, timeout_s)
    finally:
        channel.unsubscribe(on_state)


def _silent(addr: str, timeout_s: float) -> Unavailable:
    return Unavailable(f"controller {addr}: the connection was accepted but nothing "
                       f"answered within {timeout_s:g} s (not a gearshift controller, "
                       f"or a hung one?)")


@contextmanager
def control_stub(ctx: click.Context) -> Iterator[control_pb2_grpc.ControlServiceStub]:
    endpoints = controller_endpoints(ctx)
    # TLS files from $GEARSHIFT_TLS_CA/_CERT/_KEY and the token from $GEARSHIFT_TOKEN_FILE
    # or $GEARSHIFT_TOKEN: secrets never on the command line.
    try:
        tls, token = TlsFiles.from_env(), load_token()
    except GearshiftError as err:
        raise CliError(err) from None

    def open_channel(addr: str) -> grpc.Channel:
        return (secure_channel(addr, tls, token, aio=False) if tls is not None or token
                else grpc.insecure_channel(addr))

    stub = FollowingStub(endpoints, open_channel)
    try:
        yield stub  # type: ignore[misc]
    except grpc.RpcError as err:
        setup = ClientSetup(endpoints.current, tls)
        raise CliError(from_rpc_error(err, setup)) from None
    except GearshiftError as err:
        raise CliError(err) from None
    finally:
        stub.close()


def call(fn: Callable[..., T], request: object) -> T:
    return fn(request, timeout=RPC_TIMEOUT_S)


def call_pages(fn: Callable[..., T], request: Any, field: str) -> T:
    """Every page of a paged list RPC (controller/api/paging.py), as one answer: the pages'
    `field` items in order."""
    first = fn(request, timeout=RPC_TIMEOUT_S)
    resp: Any = first
    while resp.next_page_token:
        request.page_token = resp.next_page_token
        resp = fn(request, timeout=RPC_TIMEOUT_S)
        getattr(first, field).extend(getattr(resp, field))
    first.next_page_token = ""  # type: ignore[attr-defined]
    return first
