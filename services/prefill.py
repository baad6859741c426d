"""PrefillService: admit a tokenized prompt, prefill it, return the first token and a handle.

The request is submitted with `park_after_prefill=True`: after its first token the engine keeps its
KV under the request id (the handle) with a lease, until DecodeService attaches, `Release` drops it
or the lease expires. A call that ends before its first token (cancel, deadline) aborts the request.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from structlog.contextvars import bound_contextvars

from engine.errors import RequestNotFoundError
from engine.loop import EngineLoop
from engine.metrics import request_stats
from ninfer.v1 import prefill_pb2, prefill_pb2_grpc
from services.convert import sampling_from_proto, stats_to_proto
from services.errors import RpcAbort
from services.telemetry import prefill_attributes, stats_attributes

if TYPE_CHECKING:
    from services.engine_host import EngineHost

log = structlog.get_logger(__name__)


class AbortOnTermination:
    """gRPC termination callback: abort the engine request unless it was handed off (disarmed)."""

    def __init__(self, loop: EngineLoop, request_id: str):
        self._loop, self._request_id = loop, request_id
        self._armed = True
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            if self._armed:
                self._armed = False
                self._loop.abort(self._request_id)

    def disarm(self) -> None:
        with self._lock:
            self._armed = False

    @classmethod
    def register(cls, context: grpc.ServicerContext, loop: EngineLoop, request_id: str) -> "AbortOnTermination":
        guard = cls(loop, request_id)
        if not context.add_callback(guard):        # the call has ended already
            guard()
        return guard


def parked_stats(loop: EngineLoop, request_id: str) -> dict[str, Any] | None:
    """Prefill-phase stats of a parked request, read from this thread without waiting for a step.

    Safe because a parked request does not change until `resume` (which only its decode calls) or
    until it finishes (then it is gone from `parked` and this returns None).
    """
    req = loop.core.scheduler.parked.get(request_id)
    return None if req is None else request_stats(req, loop.core.config.prefill_chunk)


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, host: "EngineHost"):
        self.host = host

    def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.ServicerContext):
        host = self.host
        with host.state.admit(), bound_contextvars(request_id=request.request_id or None), \
                host.tracer.start_as_current_span("prefill") as span:
            loop = host.loop
            params = sampling_from_proto(request.sampling)
            stream = loop.submit(list(request.prompt_token_ids), params, request.request_id or None,
                                 park_after_prefill=True)
            guard = AbortOnTermination.register(context, loop, stream.request_id)
            first = stream.next()                     # QueueTimeoutError: RESOURCE_EXHAUSTED
            if first.finished:
                guard.disarm()
                if first.finish_reason == "abort":
                    raise RpcAbort(grpc.StatusCode.CANCELLED, "the prefill call ended before its first token")
                stats = first.stats
                span.set_attributes(stats_attributes(stats))
                host.metrics.observe_prefill(stats)
                host.metrics.observe_finished(stats)
                log.info("engine_request_done", **stats_attributes(stats))
            else:
                stats = parked_stats(loop, stream.request_id)
                if stats is None:                     # aborted (the call ended) or expired meanwhile
                    raise RequestNotFoundError(f"request {stream.request_id!r} ended right after its prefill")
                guard.disarm()
                span.set_attributes(prefill_attributes(stats))
                host.metrics.observe_prefill(stats)
            span.set_attribute("ninfer.request_id", stream.request_id)
            return prefill_pb2.PrefillResponse(
                handle=stream.request_id, token_ids=first.new_token_ids, finished=first.finished,
                stats=stats_to_proto(stats), lease_seconds=host.lease_seconds)

    def Release(self, request: prefill_pb2.ReleaseRequest, context: grpc.ServicerContext):
        with self.host.state.admit(during_drain=True), bound_contextvars(request_id=request.handle):
            loop = self.host.loop
            handle = request.handle
            if not loop.call(lambda core: handle in core.scheduler.parked):
                raise RequestNotFoundError(f"no prefilled handle {handle!r} (unknown, attached, expired or finished)")
            loop.abort(handle)
            return prefill_pb2.ReleaseResponse()
