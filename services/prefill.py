"""PrefillService: admit a tokenized prompt, prefill it, return the first token and a handle.

The request is submitted with `park_after_prefill=True`: after its first token the engine keeps its
KV under the request id (the handle) with a lease, until DecodeService attaches, `Release` drops it
or the lease expires. A call that ends before its first token (cancel, deadline) aborts the request;
so does a call that fails after its response was written (the client never got the handle): the
guard stays armed until the call has ended OK.
"""

from __future__ import annotations

import threading

import grpc
import structlog
from structlog.contextvars import bound_contextvars

from engine.loop import EngineLoop
from engine.request_stats import FinishReason
from ninfer.v1 import prefill_pb2, prefill_pb2_grpc
from services.convert import logprobs_to_proto, sampling_from_proto, sequence_output_to_proto, stats_to_proto
from services.engine_context import EngineContext
from services.server.errors import SHUT_DOWN_DETAILS, RpcAbort
from services.server.telemetry import prefill_attributes, stats_attributes

log = structlog.get_logger(__name__)


class AbortOnTermination:
    """Done callback of a call (and the drain's cutter): abort the engine request unless it was handed
    off or disarmed. `hand_off()`: the response is on its way; the request is aborted still if the
    call then ends cancelled (the client never got it)."""

    def __init__(self, loop: EngineLoop, request_id: str):
        self._loop, self._request_id = loop, request_id
        self._armed = True
        self._handed_off = False
        self._lock = threading.Lock()

    def __call__(self, context: grpc.aio.ServicerContext | None = None) -> None:
        failed = context is not None and context.cancelled()
        with self._lock:
            fire = self._armed and (not self._handed_off or failed)
            self._armed = False
        if fire:
            self._loop.abort(self._request_id)

    def disarm(self) -> None:
        with self._lock:
            self._armed = False

    def hand_off(self) -> None:
        with self._lock:
            self._handed_off = True

    @classmethod
    def register(cls, context: grpc.aio.ServicerContext, loop: EngineLoop, request_id: str) -> "AbortOnTermination":
        guard = cls(loop, request_id)
        if context.done():                         # the call has ended already
            guard(context)
        else:
            context.add_done_callback(guard)
        return guard


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, engine: EngineContext):
        self.ctx = engine

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        ctx = self.ctx
        with ctx.state.admit(), bound_contextvars(request_id=request.request_id or None), \
                ctx.tracer.start_as_current_span("prefill") as span:
            loop = ctx.engine
            info = ctx.info
            room = min(info.max_model_len, info.kv_capacity_tokens - info.draft_tokens) - len(request.prompt_token_ids)
            params = sampling_from_proto(request.sampling, room=room)
            stream = await loop.submit_async(list(request.prompt_token_ids), params, request.request_id or None,
                                             park_after_prefill=True,
                                             output_token_ids=list(request.output_token_ids) or None)
            guard = AbortOnTermination.register(context, loop, stream.request_id)
            with ctx.state.on_cut(guard):
                try:
                    # every sequence's first output comes in the step that ends the prefill (n > 1: forked)
                    firsts = sorted([await stream.next_async() for _ in range(params.n)], key=lambda o: o.index)
                except BaseException:                    # cancelled (client, deadline): abort it now
                    guard()
                    raise
            guard.hand_off()                          # armed until the response has gone out
            first = firsts[0]
            stats = first.stats                       # the prefill's figures, or the finished request's
            if all(o.finished for o in firsts):
                if first.finish_reason is FinishReason.ABORT:
                    if ctx.state.shut_down:
                        raise RpcAbort(grpc.StatusCode.UNAVAILABLE, SHUT_DOWN_DETAILS)
                    raise RpcAbort(grpc.StatusCode.CANCELLED, "the prefill call ended before its first token")
                span.set_attributes(stats_attributes(stats))
                ctx.metrics.observe_prefill(stats)
                ctx.metrics.observe_finished(stats)
                log.info("engine_request_done", **stats_attributes(stats))
            else:
                span.set_attributes(prefill_attributes(stats))
                ctx.metrics.observe_prefill(stats)
            span.set_attribute("ninfer.request_id", stream.request_id)
            return prefill_pb2.PrefillResponse(
                handle=stream.request_id, token_ids=first.new_token_ids, finished=all(o.finished for o in firsts),
                stats=stats_to_proto(stats), lease_seconds=ctx.info.lease_seconds, seed=stream.seed,
                logprobs=logprobs_to_proto(first.logprobs),
                prompt_logprobs=logprobs_to_proto((first.prompt_logprobs or [None])[1:]),
                sequences=[sequence_output_to_proto(o) for o in firsts] if params.n > 1 else [])

    async def Release(self, request: prefill_pb2.ReleaseRequest, context: grpc.aio.ServicerContext):
        with self.ctx.state.admit(during_drain=True), bound_contextvars(request_id=request.handle):
            await self.ctx.engine.release_async(request.handle)     # RequestNotFoundError: NOT_FOUND
            return prefill_pb2.ReleaseResponse()
