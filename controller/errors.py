"""The one exception hierarchy of gearshift.

Each error carries the gRPC status it maps to. The server interceptor maps
them to gRPC statuses once (`gearshift.controller.interceptors`), and the CLI
maps them to one `click.ClickException` each. User errors never print a
traceback.
"""

from __future__ import annotations

import grpc


class GearshiftError(Exception):
    """Base of every error gearshift raises on purpose."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(GearshiftError):
    """Bad input from a user, a config file or a peer: names what and where."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ConfigError(InvalidArgument):
    """A configuration file or option is invalid."""


class NotFound(GearshiftError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(GearshiftError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(GearshiftError):
    """The request is valid but the fleet is not in a state that allows it."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(GearshiftError):
    code = grpc.StatusCode.UNAVAILABLE


class PermissionDenied(GearshiftError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(GearshiftError):
    code = grpc.StatusCode.UNAUTHENTICATED


class ResourceExhausted(GearshiftError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class StaleEpoch(FailedPrecondition):
    """A command from a controller whose fencing epoch is older than one already seen."""


_BY_CODE: dict[grpc.StatusCode, type[GearshiftError]] = {}
for _cls in (InvalidArgument, NotFound, AlreadyExists, FailedPrecondition, Unavailable,
             PermissionDenied, Unauthenticated, ResourceExhausted):
    _BY_CODE.setdefault(_cls.code, _cls)


def from_rpc_error(err: grpc.RpcError) -> GearshiftError:
    """Turn a gRPC error received by a client back into the matching gearshift error."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _BY_CODE.get(code, GearshiftError)
    if code == grpc.StatusCode.UNAVAILABLE:
        details = f"controller unavailable: {details}"
    out = cls(details or code.name)
    out.code = code
    return out
