"""Bounded concurrency: at most `limit` calls run at once; the next one is refused at once with
RESOURCE_EXHAUSTED and retry pushback instead of waiting (a hang until its deadline).

Health, reflection and Release are exempt (a probe must answer while the server is saturated, and a
Release frees KV). A call counts from the moment its request message has arrived (see
services.server.receive: a call still waiting for its message holds no seat here) until it ends.
The refusal names no flag: the gateway passes an engine's status on to public clients, who have no
use for an engine's internal settings (the operator finds the limit in the log and in metrics).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc
import structlog
from prometheus_client import Counter

from services.server.errors import RETRY_PUSHBACK_KEY

log = structlog.get_logger(__name__)
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.", "/ninfer.v1.PrefillService/Release")


def admission_rpcs(max_batch: int, max_pending: int) -> int:
    """Calls one engine can have in flight when full: a decode stream per running request and per
    parked or attached one (at most max_batch each), a Prefill per queued request and the one in the
    prefill lane. Also the gateway's streams per engine."""
    return 2 * max_batch + max_pending + 1


class ConcurrencyLimitInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, limit: int, retry_pushback_ms: int, refused: Counter | None = None):
        if limit < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1, got {limit}")
        self.limit = limit
        self.retry_pushback_ms = retry_pushback_ms
        self.active = 0                 # touched on the server's event loop only
        self.refused = 0
        self._refused_metric = refused

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(EXEMPT_PREFIXES):
            return handler
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._wrap_unary(handler.unary_unary))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._wrap_stream(handler.unary_stream))
        return handler

    async def _enter(self, context: grpc.aio.ServicerContext) -> None:
        if self.active < self.limit:
            self.active += 1
            return
        self.refused += 1
        if self._refused_metric is not None:
            self._refused_metric.inc()
        if self.refused == 1 or self.refused % 1000 == 0:
            log.warning("concurrency_limit_reached", limit=self.limit, refused=self.refused,
                        hint="raise --max-concurrent-rpcs, or add engines")
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"the server is at its limit of {self.limit} concurrent calls; retry later",
                            trailing_metadata=((RETRY_PUSHBACK_KEY, str(self.retry_pushback_ms)),))

    def _wrap_unary(self, behavior: Callable) -> Callable:
        async def unary(request, context):
            await self._enter(context)
            try:
                return await behavior(request, context)
            finally:
                self.active -= 1
        return unary

    def _wrap_stream(self, behavior: Callable) -> Callable:
        async def stream(request, context) -> AsyncIterator:
            await self._enter(context)
            try:
                async for response in behavior(request, context):
                    yield response
            finally:
                self.active -= 1
        return stream
