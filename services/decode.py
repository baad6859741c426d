"""DecodeService: attach to a prefilled handle and stream its tokens, one message per engine step."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc
import structlog
from structlog.contextvars import bound_contextvars

from engine.loop import RequestStream
from engine.request_stats import FinishReason, RequestStats
from ninfer.v1 import decode_pb2, decode_pb2_grpc
from services.convert import logprobs_to_proto, stats_to_proto
from services.engine_context import EngineContext
from services.server.errors import SHUT_DOWN_DETAILS, RpcAbort
from services.prefill import AbortOnTermination
from services.server.prometheus import observe_per_token
from services.server.telemetry import stats_attributes

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = structlog.get_logger(__name__)
FINAL_OUTPUT_WAIT_S = 10.0       # an aborted request's final output comes within one engine step


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, engine: EngineContext):
        self.ctx = engine

    async def Decode(self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        ctx = self.ctx
        # A decode finishes work admitted before a drain began: it passes while draining.
        with ctx.state.admit(during_drain=True), bound_contextvars(request_id=request.handle), \
                ctx.tracer.start_as_current_span("decode") as span:
            loop = ctx.engine
            stream = await loop.resume_async(request.handle)        # RequestNotFoundError: NOT_FOUND
            # Cancelled or past its deadline: the request is aborted before the next engine step.
            guard = AbortOnTermination.register(context, loop, request.handle)
            span.set_attribute("ninfer.request_id", request.handle)
            with ctx.state.on_cut(guard):                  # the drain timeout: aborted, UNAVAILABLE
                async for response in self._stream(stream, guard, span):
                    yield response

    async def _stream(self, stream: RequestStream, guard: AbortOnTermination, span: "Span"):
        ctx = self.ctx
        try:
            last = time.monotonic()
            async for out in stream:
                now = time.monotonic()
                if out.new_token_ids:
                    observe_per_token(ctx.metrics.inter_token, now - last, len(out.new_token_ids))
                last = now
                logprobs = logprobs_to_proto(out.logprobs)
                if not out.finished:
                    yield decode_pb2.DecodeResponse(token_ids=out.new_token_ids, index=out.index, logprobs=logprobs)
                    continue
                if stream.finished:                        # n > 1: the last sequence's final
                    guard.disarm()
                self._report(out.stats, span)
                if out.finish_reason is FinishReason.ABORT:  # the call ended (cancel, deadline): no one listens
                    if ctx.state.shut_down:
                        raise RpcAbort(grpc.StatusCode.UNAVAILABLE, SHUT_DOWN_DETAILS)
                    raise RpcAbort(grpc.StatusCode.CANCELLED, "the decode stream was cancelled")
                yield decode_pb2.DecodeResponse(token_ids=out.new_token_ids, finished=True, index=out.index,
                                                stats=stats_to_proto(out.stats), logprobs=logprobs)
        except (GeneratorExit, asyncio.CancelledError):   # the call ended: the client is gone
            if not stream.finished:
                guard()
                await self._report_when_aborted(stream, span)
            raise

    async def _report_when_aborted(self, stream: RequestStream, span: "Span") -> None:
        """Read an aborted stream up to its (last sequence's) final output and report its stats (if it comes)."""
        try:
            async with asyncio.timeout(FINAL_OUTPUT_WAIT_S):
                while True:
                    out = await stream.next_async()
                    if stream.finished:
                        self._report(out.stats, span)
                        return
        except TimeoutError:
            log.warning("final_output_missing", request_id=stream.request_id)
        except Exception:  # noqa: BLE001 - the engine died meanwhile: nothing to report
            pass

    def _report(self, stats: RequestStats, span: "Span") -> None:
        span.set_attributes(stats_attributes(stats))
        self.ctx.metrics.observe_finished(stats)
        log.info("engine_request_done", **stats_attributes(stats))
