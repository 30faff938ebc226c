"""Map gearshift errors to gRPC statuses, once, for every service.

A handler raises a `GearshiftError`; this interceptor turns the plain code it
carries into the gRPC status of that name (`grpc_status`), with its message as
the details. A database error becomes UNAVAILABLE "the store refused the write:
<cause>" (`controller.store.errors`). Anything else is logged
with its traceback and returned as INTERNAL without internals.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import sqlalchemy as sa
from grpc import aio

from gearshift.common.errors import GearshiftError
from gearshift.controller.store.errors import store_refused

log = logging.getLogger(__name__)


def grpc_status(err: GearshiftError) -> grpc.StatusCode:
    """The gRPC status an error's plain code names (the one place codes meet gRPC)."""
    return grpc.StatusCode[err.code.value]


async def _abort(context: aio.ServicerContext, exc: BaseException) -> None:
    if isinstance(exc, sa.exc.SQLAlchemyError):  # one line naming the cause, no traceback
        refused = store_refused(exc)
        log.error("%s", refused.message)
        exc = refused
    if isinstance(exc, GearshiftError):
        await context.abort(grpc_status(exc), exc.message)
    log.exception("unhandled error in handler", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the controller log")


def _wrap_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except (GearshiftError, ValueError, TypeError, sa.exc.SQLAlchemyError) as exc:
            await _abort(context, exc)

    return wrapper


def _wrap_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def wrapper(request: Any, context: aio.ServicerContext) -> Any:
        try:
            async for item in behavior(request, context):
                yield item
        except (GearshiftError, sa.exc.SQLAlchemyError) as exc:
            await _abort(context, exc)

    return wrapper


class ErrorInterceptor(aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
