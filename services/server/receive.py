"""Calls that wait for their request message: bounded in time, counted, holding no seat.

A gRPC call opens with HEADERS; its request message follows in DATA frames. A client that sends the
headers and never the message (a header-only stream, or a very slow sender) used to hold a server
thread, and (once the message arrived) a concurrency seat, for as long as it liked. Here every call
with a single request message is served as a stream-request call at the transport (the wire format
is the same) whose first act is to read that message under `receive_timeout_s`: the call waits as a
coroutine (no thread, no seat: the interceptors after this one, the concurrency limit and the
bearer-token check included, run once the message is there), is counted in
`ninfer_rpc_awaiting_message`, and ends DEADLINE_EXCEEDED at the timeout
(`ninfer_rpc_receive_timeouts_total`). This interceptor goes first in the chain.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc

from services.server.metrics import ServerMetrics


class ReceiveTimeoutInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, receive_timeout_s: float, metrics: ServerMetrics):
        self.timeout_s = receive_timeout_s
        self.metrics = metrics
        self.awaiting = 0                    # calls waiting for their message now (event loop only)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(
                self._stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer)
        return grpc.stream_unary_rpc_method_handler(
            self._unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer)

    async def _receive(self, requests: AsyncIterator, context: grpc.aio.ServicerContext):
        self.awaiting += 1
        try:
            async with asyncio.timeout(self.timeout_s):
                return await anext(requests)
        except TimeoutError:
            self.metrics.receive_timeouts.inc()
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no request message within {self.timeout_s:g} s of the call's headers")
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call ended without a request message")
        finally:
            self.awaiting -= 1

    def _unary(self, behavior: Callable) -> Callable:
        async def unary(requests, context):
            return await behavior(await self._receive(requests, context), context)
        return unary

    def _stream(self, behavior: Callable) -> Callable:
        async def stream(requests, context) -> AsyncIterator:
            async for response in behavior(await self._receive(requests, context), context):
                yield response
        return stream
