"""The CLI's connection to the controller, and the one mapping of errors to exits."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ClassVar, TypeVar

import click
import grpc

from gearshift.controller.credentials import TlsFiles, load_token, secure_channel
from gearshift.controller.errors import GearshiftError, from_rpc_error
from gearshift.v1 import control_pb2_grpc

DEFAULT_CONTROLLER = "127.0.0.1:50051"
RPC_TIMEOUT_S = 10.0

T = TypeVar("T")


class CliError(click.ClickException):
    """A gearshift error shown to a person: message only, exit code by status."""

    EXIT_BY_CODE: ClassVar[dict[grpc.StatusCode, int]] = {
        grpc.StatusCode.INVALID_ARGUMENT: 2,
        grpc.StatusCode.NOT_FOUND: 3,
        grpc.StatusCode.FAILED_PRECONDITION: 4,
        grpc.StatusCode.UNAVAILABLE: 5,
        grpc.StatusCode.PERMISSION_DENIED: 6,
        grpc.StatusCode.UNAUTHENTICATED: 6,
    }

    def __init__(self, err: GearshiftError) -> None:
        super().__init__(err.message)
        self.exit_code = self.EXIT_BY_CODE.get(err.code, 1)  # type: ignore[misc]


def controller_address(ctx: click.Context) -> str:
    root = ctx.find_root()
    addr = (root.obj or {}).get("controller") if root.obj else None
    return addr or os.environ.get("GEARSHIFT_CONTROLLER") or DEFAULT_CONTROLLER


@contextmanager
def control_stub(ctx: click.Context) -> Iterator[control_pb2_grpc.ControlServiceStub]:
    addr = controller_address(ctx)
    # TLS files from $GEARSHIFT_TLS_CA/_CERT/_KEY and the token from $GEARSHIFT_TOKEN_FILE
    # or $GEARSHIFT_TOKEN: secrets never on the command line.
    try:
        tls, token = TlsFiles.from_env(), load_token()
    except GearshiftError as err:
        raise CliError(err) from None
    opened = (secure_channel(addr, tls, token, aio=False) if tls is not None or token
              else grpc.insecure_channel(addr))
    with opened as channel:
        try:
            yield control_pb2_grpc.ControlServiceStub(channel)
        except grpc.RpcError as err:
            raise CliError(from_rpc_error(err)) from None
        except GearshiftError as err:
            raise CliError(err) from None


def call(fn: Callable[..., T], request: object) -> T:
    return fn(request, timeout=RPC_TIMEOUT_S)
