"""Bounded concurrency: at most `limit` calls run at once; the next one is refused at once with
RESOURCE_EXHAUSTED and retry pushback instead of waiting for a thread (a hang until its deadline).

Health, reflection and Release are exempt (a probe must answer while the server is saturated, and a
Release frees KV). The server's thread pool has `limit + HEADROOM_THREADS` threads, so that an exempt
call or a refusal always finds one; grpc's own `maximum_concurrent_rpcs` is set to the pool's size
as a backstop (past it grpc refuses without pushback, but never queues a call behind busy threads).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc

from services.server.errors import RETRY_PUSHBACK_KEY

HEADROOM_THREADS = 16
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.", "/ninfer.v1.PrefillService/Release")


def admission_rpcs(max_batch: int, max_pending: int) -> int:
    """Calls one engine can have in flight when full: a decode stream per running request and per
    parked or attached one (at most max_batch each), a Prefill per queued request and the one in the
    prefill lane. Also the gateway's streams per engine."""
    return 2 * max_batch + max_pending + 1


class ConcurrencyLimitInterceptor(grpc.ServerInterceptor):
    def __init__(self, limit: int, retry_pushback_ms: int):
        if limit < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1, got {limit}")
        self.limit = limit
        self.retry_pushback_ms = retry_pushback_ms
        self.active = 0
        self._lock = threading.Lock()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(EXEMPT_PREFIXES):
            return handler
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._wrap_unary(handler.unary_unary))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._wrap_stream(handler.unary_stream))
        return handler

    def _enter(self, context: grpc.ServicerContext) -> None:
        with self._lock:
            if self.active < self.limit:
                self.active += 1
                return
        context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(self.retry_pushback_ms)),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"the server is at its limit of {self.limit} concurrent calls (--max-concurrent-rpcs)")

    def _exit(self) -> None:
        with self._lock:
            self.active -= 1

    def _wrap_unary(self, behavior: Callable) -> Callable:
        def unary(request, context):
            self._enter(context)
            try:
                return behavior(request, context)
            finally:
                self._exit()
        return unary

    def _wrap_stream(self, behavior: Callable) -> Callable:
        def stream(request, context) -> Iterator:
            self._enter(context)
            try:
                yield from behavior(request, context)
            finally:
                self._exit()
        return stream
