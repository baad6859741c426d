"""Exceptions -> gRPC status, in one table (docs/architecture.md, "Error model"), and the interceptor that applies it.

Servicers raise domain errors (engine.errors) or `RpcAbort`; they never call `context.abort`. The
gateway passes an engine's status through unchanged, retry pushback included.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from engine.errors import (EngineDeadError, InvalidArgumentError, QueueFullError, QueueTimeoutError,
                           RequestNotFoundError, UnsupportedError)

log = structlog.get_logger(__name__)
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"     # gRPC's retry-throttling trailer (A6 retry design)


SHUT_DOWN_DETAILS = "the server shut down (its drain timeout passed) before this call finished"


class RpcAbort(Exception):
    """End the call with this status (not ready, draining, cancelled, no engine...); `pushback`:
    with the server's grpc-retry-pushback-ms."""

    def __init__(self, code: grpc.StatusCode, details: str, pushback: bool = False):
        super().__init__(details)
        self.code = code
        self.details = details
        self.pushback = pushback


@dataclass(frozen=True)
class Unreadable:
    """What the lenient deserializer returns for a request message it cannot take: the handler
    raises `error` (INVALID_ARGUMENT for malformed bytes, RESOURCE_EXHAUSTED for too many)."""

    error: RpcAbort


def lenient(deserializer: Callable[[bytes], Any] | None, max_bytes: int) -> Callable[[bytes], Any]:
    """A request deserializer that never raises (grpc would answer INTERNAL): oversized or malformed
    bytes become an `Unreadable` the wrapped handler turns into its status."""
    def deserialize(data: bytes):
        if len(data) > max_bytes:
            return Unreadable(RpcAbort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                       f"request message of {len(data)} bytes exceeds the limit of {max_bytes} "
                                       "bytes (--max-message-bytes)", pushback=True))
        if deserializer is None:
            return data
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
            return Unreadable(RpcAbort(grpc.StatusCode.INVALID_ARGUMENT,
                                       f"malformed request message ({type(e).__name__}: {e})"[:300]))
    return deserialize


@dataclass(frozen=True)
class RpcStatus:
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str], ...] = ()


def status_for(exc: BaseException, retry_pushback_ms: int) -> RpcStatus:
    """The status a client sees for `exc`."""
    if isinstance(exc, RpcAbort):
        return RpcStatus(exc.code, exc.details,
                         ((RETRY_PUSHBACK_KEY, str(retry_pushback_ms)),) if exc.pushback else ())
    if isinstance(exc, InvalidArgumentError):
        return RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, (QueueFullError, QueueTimeoutError)):
        return RpcStatus(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc),
                         ((RETRY_PUSHBACK_KEY, str(retry_pushback_ms)),))
    if isinstance(exc, RequestNotFoundError):
        return RpcStatus(grpc.StatusCode.NOT_FOUND, str(exc))
    if isinstance(exc, UnsupportedError):
        return RpcStatus(grpc.StatusCode.UNIMPLEMENTED, str(exc))
    if isinstance(exc, EngineDeadError):
        return RpcStatus(grpc.StatusCode.UNAVAILABLE, str(exc))
    if isinstance(exc, (grpc.FutureCancelledError, asyncio.CancelledError)):
        return RpcStatus(grpc.StatusCode.CANCELLED, "cancelled")
    if isinstance(exc, GeneratorExit):                  # the server dropped a stream: the client left
        return RpcStatus(grpc.StatusCode.CANCELLED, "cancelled by the client")
    if isinstance(exc, grpc.aio.AioRpcError):           # an upstream call: pass it on
        pushback = tuple((k, v) for k, v in (exc.trailing_metadata() or ()) if k == RETRY_PUSHBACK_KEY)
        return RpcStatus(exc.code(), exc.details() or "", pushback)
    if isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call):
        pushback = tuple((m.key, m.value) for m in (exc.trailing_metadata() or ()) if m.key == RETRY_PUSHBACK_KEY)
        return RpcStatus(exc.code(), exc.details() or "", pushback)
    return RpcStatus(grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__})")


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns what a servicer raises into its status (and trailing metadata); logs the unexpected."""

    def __init__(self, retry_pushback_ms: int, max_message_bytes: int):
        self.retry_pushback_ms = retry_pushback_ms
        self.max_message_bytes = max_message_bytes

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        read = lenient(handler.request_deserializer, self.max_message_bytes)
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._wrap_unary(handler.unary_unary, method), request_deserializer=read)
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._wrap_stream(handler.unary_stream, method),
                                    request_deserializer=read)
        return handler

    def _wrap_unary(self, behavior: Callable, method: str) -> Callable:
        async def unary(request, context):
            try:
                if isinstance(request, Unreadable):
                    raise request.error
                return await behavior(request, context)
            except grpc.aio.AbortError:                 # context.abort() was called already
                raise
            except Exception as e:  # noqa: BLE001 - every error becomes a status
                await self._abort(context, e, method)
        return unary

    def _wrap_stream(self, behavior: Callable, method: str) -> Callable:
        async def stream(request, context) -> AsyncIterator:
            try:
                if isinstance(request, Unreadable):
                    raise request.error
                async for response in behavior(request, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as e:  # noqa: BLE001 - every error becomes a status
                await self._abort(context, e, method)
        return stream

    async def _abort(self, context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
        status = status_for(exc, self.retry_pushback_ms)
        if status.code is grpc.StatusCode.INTERNAL:
            log.error("rpc_failed", method=method, exc_info=exc)
        if context.done():                     # ended already (deadline, cancel): no status to send
            raise asyncio.CancelledError()
        await context.abort(status.code, status.details, trailing_metadata=status.trailing_metadata)
