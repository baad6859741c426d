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


def call_failed(context: grpc.ServicerContext) -> bool:
    """In a termination callback: whether the call ended cancelled (by the client, its deadline or the
    transport) rather than with its status sent. grpc's sync server has no public accessor for this;
    it is the call state's `client` field ("cancelled"). Unknown: False (the lease still frees it)."""
    state = getattr(context, "_state", None)
    return getattr(state, "client", None) == "cancelled"


class AbortOnTermination:
    """gRPC termination callback: abort the engine request unless it was handed off (disarmed).
    `hand_off()`: the response is on its way; the request is aborted still if the call then fails."""

    def __init__(self, loop: EngineLoop, request_id: str, context: grpc.ServicerContext | None = None):
        self._loop, self._request_id, self._context = loop, request_id, context
        self._armed = True
        self._handed_off = False
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fire = self._armed and (not self._handed_off or call_failed(self._context))
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
    def register(cls, context: grpc.ServicerContext, loop: EngineLoop, request_id: str) -> "AbortOnTermination":
        guard = cls(loop, request_id, context)
        if not context.add_callback(guard):        # the call has ended already
            guard()
        return guard


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, engine: EngineContext):
        self.ctx = engine

    def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.ServicerContext):
        ctx = self.ctx
        with ctx.state.admit(), bound_contextvars(request_id=request.request_id or None), \
                ctx.tracer.start_as_current_span("prefill") as span:
            loop = ctx.engine
            info = ctx.info
            room = min(info.max_model_len, info.kv_capacity_tokens - info.draft_tokens) - len(request.prompt_token_ids)
            params = sampling_from_proto(request.sampling, room=room)
            stream = loop.submit(list(request.prompt_token_ids), params, request.request_id or None,
                                 park_after_prefill=True)
            guard = AbortOnTermination.register(context, loop, stream.request_id)
            with ctx.state.on_cut(guard):
                # every sequence's first output comes in the step that ends the prefill (n > 1: forked)
                firsts = sorted((stream.next() for _ in range(params.n)), key=lambda o: o.index)
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
                stats=stats_to_proto(stats), lease_seconds=ctx.info.lease_seconds,
                logprobs=logprobs_to_proto(first.logprobs),
                prompt_logprobs=logprobs_to_proto((first.prompt_logprobs or [None])[1:]),
                sequences=[sequence_output_to_proto(o) for o in firsts] if params.n > 1 else [])

    def Release(self, request: prefill_pb2.ReleaseRequest, context: grpc.ServicerContext):
        with self.ctx.state.admit(during_drain=True), bound_contextvars(request_id=request.handle):
            self.ctx.engine.release(request.handle)         # RequestNotFoundError: NOT_FOUND
            return prefill_pb2.ReleaseResponse()
