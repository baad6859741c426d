"""DecodeService: attach to a prefilled handle and stream its tokens, one message per engine step."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import grpc
import structlog
from structlog.contextvars import bound_contextvars

from ninfer.v1 import decode_pb2, decode_pb2_grpc
from services.convert import stats_to_proto
from services.errors import RpcAbort
from services.prefill import AbortOnTermination
from services.telemetry import stats_attributes

if TYPE_CHECKING:
    from services.engine_host import EngineHost

log = structlog.get_logger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, host: "EngineHost"):
        self.host = host

    def Decode(self, request: decode_pb2.DecodeRequest, context: grpc.ServicerContext):
        host = self.host
        # A decode finishes work admitted before a drain began: it passes while draining.
        with host.state.admit(during_drain=True), bound_contextvars(request_id=request.handle), \
                host.tracer.start_as_current_span("decode") as span:
            loop = host.loop
            stream = loop.resume(request.handle)           # RequestNotFoundError: NOT_FOUND
            # Cancelled or past its deadline: the request is aborted before the next engine step.
            guard = AbortOnTermination.register(context, loop, request.handle)
            span.set_attribute("ninfer.request_id", request.handle)
            last = time.monotonic()
            for out in stream:
                now = time.monotonic()
                if out.new_token_ids:
                    host.metrics.observe_tokens(now - last, len(out.new_token_ids))
                last = now
                if not out.finished:
                    yield decode_pb2.DecodeResponse(token_ids=out.new_token_ids)
                    continue
                guard.disarm()
                stats = out.stats
                span.set_attributes(stats_attributes(stats))
                host.metrics.observe_finished(stats)
                log.info("engine_request_done", **stats_attributes(stats))
                if out.finish_reason == "abort":          # the call ended (cancel, deadline): no one listens
                    raise RpcAbort(grpc.StatusCode.CANCELLED, "the decode stream was cancelled")
                yield decode_pb2.DecodeResponse(token_ids=out.new_token_ids, finished=True,
                                                stats=stats_to_proto(stats))
