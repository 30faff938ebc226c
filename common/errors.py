"""The one exception hierarchy of gearshift.

Each error carries a plain status code (`ErrorCode`, named like the gRPC status
it stands for) and no wire type, so the decision core can raise them without
importing gRPC. The controller's interceptor maps the code to a gRPC status
once (`gearshift.controller.api.interceptors.grpc_status`), and the CLI maps gRPC
statuses back to these errors and to exits (`gearshift.cli.client`). User
errors never print a traceback.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """Why a request failed; each value is the name of the gRPC status it maps to."""

    INTERNAL = "INTERNAL"                        # a bug or an unexpected failure
    INVALID_ARGUMENT = "INVALID_ARGUMENT"        # bad input: names what and where
    NOT_FOUND = "NOT_FOUND"                      # no such object
    ALREADY_EXISTS = "ALREADY_EXISTS"            # an object of that name exists
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # valid, but not in this state of the fleet
    UNAVAILABLE = "UNAVAILABLE"                  # a peer did not answer; try again
    PERMISSION_DENIED = "PERMISSION_DENIED"      # authenticated, but not allowed
    UNAUTHENTICATED = "UNAUTHENTICATED"          # no or bad credentials
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"    # a limit was reached


class GearshiftError(Exception):
    """Base of every error gearshift raises on purpose."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(GearshiftError):
    """Bad input from a user, a config file or a peer: names what and where."""

    code = ErrorCode.INVALID_ARGUMENT


class ConfigError(InvalidArgument):
    """A configuration file or option is invalid."""


class NotFound(GearshiftError):
    code = ErrorCode.NOT_FOUND


class AlreadyExists(GearshiftError):
    code = ErrorCode.ALREADY_EXISTS


class FailedPrecondition(GearshiftError):
    """The request is valid but the fleet is not in a state that allows it."""

    code = ErrorCode.FAILED_PRECONDITION


class Unavailable(GearshiftError):
    code = ErrorCode.UNAVAILABLE


class PermissionDenied(GearshiftError):
    code = ErrorCode.PERMISSION_DENIED


class Unauthenticated(GearshiftError):
    code = ErrorCode.UNAUTHENTICATED


class ResourceExhausted(GearshiftError):
    code = ErrorCode.RESOURCE_EXHAUSTED


ERROR_BY_CODE: dict[ErrorCode, type[GearshiftError]] = {}
for _cls in (InvalidArgument, NotFound, AlreadyExists, FailedPrecondition, Unavailable,
             PermissionDenied, Unauthenticated, ResourceExhausted):
    ERROR_BY_CODE.setdefault(_cls.code, _cls)


def error_for(code_name: str, message: str) -> GearshiftError:
    """The error class for a status named `code_name` (e.g. a gRPC status name)."""
    try:
        code = ErrorCode(code_name)
    except ValueError:
        code = ErrorCode.INTERNAL
    out = ERROR_BY_CODE.get(code, GearshiftError)(message or code_name)
    out.code = code
    return out
