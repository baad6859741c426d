"""Gateway.Generate: one client stream = a Prefill call and a Decode stream on one engine.

    client --Generate--> [validate, tokenize] --Prefill(ids)--> engine: handle, first token
                         [detokenize]         --Decode(handle)--> engine: tokens ... final stats

The client's deadline goes to both calls (what is left of it); a client that goes away cancels the
engine call in flight (the engine aborts within one step). The gateway owns the handle (= its request
id) from the Prefill call until the Decode stream's first message proves the engine attached it: a
Prefill or Decode call that fails in between is followed by a Release (NOT_FOUND is fine), so that no
handle waits for its lease.
"""

from __future__ import annotations

import threading
import time
import uuid

import grpc
import structlog
from opentelemetry.propagate import inject
from opentelemetry.trace import SpanKind, Tracer
from structlog.contextvars import bound_contextvars

from ninfer.v1 import common_pb2, decode_pb2, engine_info_pb2, gateway_pb2, gateway_pb2_grpc, prefill_pb2
from services.convert import stats_from_proto
from services.server.errors import SHUT_DOWN_DETAILS, RpcAbort, status_for
from services.server.lifecycle import ServingState
from services.server.prometheus import GatewayPrometheus
from gateway.prepare import prepare
from gateway.report import RequestRecord, report
from gateway.router import Engine, EngineRouter
from gateway.text import StreamingText

log = structlog.get_logger(__name__)
DECODE_METHOD = "/ninfer.v1.DecodeService/Decode"
DECODE_SPAN_ATTRIBUTES = {"rpc.system": "grpc", "rpc.service": "ninfer.v1.DecodeService", "rpc.method": "Decode",
                          "rpc.grpc.status_code": grpc.StatusCode.OK.value[0]}
NO_DEADLINE_S = 1e8           # grpc reports ~forever when the client set no deadline
RELEASE_TIMEOUT_S = 5.0


class CallCanceller:
    """Termination callback of the client's call: cancels whichever engine call is in flight."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._call: grpc.Future | grpc.Call | None = None
        self._terminated = False

    def __call__(self) -> None:
        with self._lock:
            self._terminated = True
            call = self._call
        if call is not None:
            call.cancel()

    def watch(self, call) -> None:
        with self._lock:
            self._call = call
            terminated = self._terminated
        if terminated:
            call.cancel()


def time_left(context: grpc.ServicerContext) -> float | None:
    """The client's remaining deadline in seconds, for the next engine call (None: no deadline)."""
    left = context.time_remaining()
    if left is None or left > NO_DEADLINE_S:
        return None
    if left <= 0:
        raise RpcAbort(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed")
    return left


# The client's deadline fires on the client, which cancels the call; the gateway's copy of the deadline started when
# the request's headers arrived, a little later. On a loaded machine that skew left a timed-out call counted as
# CANCELLED (a CI run with two test workers on two cores). A cancel this close to the deadline is taken as the deadline.
DEADLINE_SKEW_S = 0.25


def past_deadline(context: grpc.ServicerContext) -> bool:
    """Whether the call's deadline has passed, give or take the client-to-gateway skew (DEADLINE_SKEW_S)."""
    left = context.time_remaining()
    return left is not None and left <= DEADLINE_SKEW_S


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, router: EngineRouter, state: ServingState, tracer: Tracer, metrics: GatewayPrometheus):
        self.router = router
        self.state = state
        self.tracer = tracer
        self.metrics = metrics

    def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.ServicerContext):
        record = RequestRecord(request_id=uuid.uuid4().hex, received=time.monotonic())
        with bound_contextvars(request_id=record.request_id), \
                self.tracer.start_as_current_span("generate") as span:
            canceller = CallCanceller()
            try:
                with self.state.admit(), self.state.on_cut(canceller):
                    yield from self._generate(request, context, record, canceller)
                record.status = grpc.StatusCode.OK
            except BaseException as e:        # GeneratorExit too: the client went away
                if self.state.shut_down and not isinstance(e, GeneratorExit):
                    record.status = grpc.StatusCode.UNAVAILABLE          # cut at the drain timeout
                    raise RpcAbort(grpc.StatusCode.UNAVAILABLE, SHUT_DOWN_DETAILS) from e
                record.status = status_for(e, 0).code
                if record.status is grpc.StatusCode.CANCELLED and past_deadline(context):
                    record.status = grpc.StatusCode.DEADLINE_EXCEEDED     # what the client saw
                raise
            finally:
                report(record, span, self.metrics)

    def _generate(self, request: gateway_pb2.GenerateRequest, context, record: RequestRecord,
                  canceller: CallCanceller):
        model = self.router.model
        if model is None:
            raise RpcAbort(grpc.StatusCode.UNAVAILABLE, "no engine has reported its model yet")
        record.model = model.info.model
        record.sampling = request.sampling
        prepared = prepare(request, model, wait_s=time_left(context))
        params = prepared.params
        record.operation, record.prompt_tokens = prepared.operation, len(prepared.prompt_ids)
        record.tokenize_s = time.monotonic() - record.received
        texts = [StreamingText(model.tokenizer, prepared.prompt_ids, params.stop, params.include_stop_str_in_output,
                               params.min_tokens, params.skip_special_tokens, params.spaces_between_special_tokens)
                 for _ in range(params.n)]
        if not context.add_callback(canceller):
            raise RpcAbort(grpc.StatusCode.CANCELLED, "the client went away")
        engine, first = self._prefill(request, prepared.prompt_ids, context, record, canceller)
        record.engine = engine.address
        handle = None if first.finished else first.handle        # a handle no decode has attached yet
        try:
            opts = request.stream_options
            sequences = list(first.sequences) or [common_pb2.SequenceOutput(
                index=0, token_ids=first.token_ids, finished=first.finished, stats=first.stats,
                logprobs=first.logprobs)]
            prompt_logprobs = first.prompt_logprobs
            unfinished = params.n
            # The first tokens go out before the decode call starts: starting a gRPC call costs about a
            # millisecond of Python, which would otherwise add to the time to first token.
            for seq in sequences:
                yield self._message(record, texts[seq.index], seq, first.stats.usage, opts, prompt_logprobs)
                prompt_logprobs = ()
                unfinished -= seq.finished
            if not unfinished:
                return
            if not context.is_active():
                raise RpcAbort(grpc.StatusCode.CANCELLED, "the client went away after the prefill")
            # The decode stream's client span is made here: the instrumentation's stream wrapper would
            # hide the call's cancel(). The traceparent goes in the call's metadata.
            with self.tracer.start_as_current_span(DECODE_METHOD, kind=SpanKind.CLIENT,
                                                   attributes=DECODE_SPAN_ATTRIBUTES) as span:
                carrier: dict[str, str] = {}
                inject(carrier)
                call = engine.decode.Decode(decode_pb2.DecodeRequest(handle=handle), timeout=time_left(context),
                                            metadata=(*self.router.metadata, *carrier.items()))
                canceller.watch(call)
                try:
                    for msg in call:           # read to the stream's end, so that it ends OK, not cancelled
                        handle = None          # a message: the engine attached the handle, the stream owns it
                        reply = self._message(record, texts[msg.index], msg, first.stats.usage, opts, ())
                        if reply is not None:
                            yield reply
                        unfinished -= msg.finished
                except grpc.RpcError as e:
                    span.set_attribute("rpc.grpc.status_code", e.code().value[0])
                    raise
                if unfinished:
                    raise RpcAbort(grpc.StatusCode.UNAVAILABLE, f"engine {engine.address} ended the stream early")
        finally:
            self.router.release(engine)
            if handle is not None:
                self._release_handle(engine, handle)

    def _message(self, record: RequestRecord, text: StreamingText, seq, usage: common_pb2.Usage,
                 opts: gateway_pb2.StreamOptions, prompt_logprobs) -> gateway_pb2.GenerateResponse | None:
        """The client's message for one sequence's engine output (a prefill's first or a decode step's);
        None when it would carry nothing (text held back, no token ids or usage asked for)."""
        delta = text.push(list(seq.token_ids), final=seq.finished)
        record.token_sent(len(seq.token_ids), self.metrics)
        if seq.finished:
            return self._final(record, delta, seq, opts, prompt_logprobs)
        if not (delta or opts.include_token_ids or opts.continuous_usage_stats or seq.logprobs or prompt_logprobs
                or not record.first_message_sent):
            return None
        record.first_message_sent = True
        msg = self._chunk(record, delta, seq.token_ids, usage, opts)
        msg.index = seq.index
        msg.logprobs.extend(seq.logprobs)
        msg.prompt_logprobs.extend(prompt_logprobs)
        return msg

    def _prefill(self, request, prompt_ids: list[int], context, record: RequestRecord,
                 canceller: CallCanceller) -> tuple[Engine, prefill_pb2.PrefillResponse]:
        """Prefill on the least-loaded engine; an engine that turns out UNAVAILABLE (down, draining)
        is skipped for the next one, since nothing ran there."""
        tried: tuple[Engine, ...] = ()
        message = prefill_pb2.PrefillRequest(request_id=record.request_id, prompt_token_ids=prompt_ids,
                                             sampling=request.sampling)
        while True:
            timeout = time_left(context)          # before the engine's count is taken: it may raise
            engine = self.router.acquire(exclude=tried)
            start = time.monotonic()
            try:
                future = engine.prefill.Prefill.future(message, timeout=timeout, metadata=self.router.metadata)
                canceller.watch(future)
                response = future.result()
            except grpc.RpcError as e:
                self.router.release(engine)
                if e.code() is grpc.StatusCode.UNAVAILABLE and context.is_active():
                    self.router.mark_unavailable(engine)
                    tried += (engine,)
                    log.warning("engine_unavailable", engine=engine.address, details=e.details())
                    continue
                if e.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                    # the engine may have parked it as the call ended: its response was lost
                    self._release_handle(engine, record.request_id)
                raise
            except BaseException:
                self.router.release(engine)
                self._release_handle(engine, record.request_id)
                raise
            record.prefill_call_s = time.monotonic() - start
            return engine, response

    def _release_handle(self, engine: Engine, handle: str) -> None:
        """Release without waiting for the answer: NOT_FOUND (attached, finished or never parked) is
        the usual one; anything else is logged (the lease frees the handle then)."""
        future = engine.prefill.Release.future(prefill_pb2.ReleaseRequest(handle=handle), timeout=RELEASE_TIMEOUT_S,
                                               metadata=self.router.metadata)

        def done(f: grpc.Future) -> None:
            e = f.exception()
            if e is not None and e.code() is not grpc.StatusCode.NOT_FOUND:
                log.warning("release_failed", engine=engine.address, handle=handle, code=e.code().name,
                            details=e.details())
        future.add_done_callback(done)

    def _chunk(self, record: RequestRecord, text: str, token_ids, usage: common_pb2.Usage,
               opts: gateway_pb2.StreamOptions) -> gateway_pb2.GenerateResponse:
        msg = gateway_pb2.GenerateResponse(request_id=record.request_id, text=text)
        if opts.include_token_ids:
            msg.token_ids.extend(token_ids)
        if opts.continuous_usage_stats:
            msg.usage.CopyFrom(usage)
            msg.usage.completion_tokens = record.completion_tokens
        return msg

    def _final(self, record: RequestRecord, text: str, seq, opts: gateway_pb2.StreamOptions,
               prompt_logprobs=()) -> gateway_pb2.GenerateResponse:
        """A sequence's last message: its text, usage and result (engine stats, gateway timings)."""
        record.first_message_sent = True
        stats = seq.stats
        record.stats = stats_from_proto(stats)
        record.result = gateway_pb2.GenerateResult(stats=stats, gateway_timings=record.gateway_timings(),
                                                   model=record.model, engine=record.engine)
        msg = gateway_pb2.GenerateResponse(request_id=record.request_id, text=text, usage=stats.usage,
                                           result=record.result, index=seq.index, logprobs=seq.logprobs,
                                           prompt_logprobs=prompt_logprobs)
        if opts.include_token_ids:
            msg.token_ids.extend(seq.token_ids)
        return msg

    def GetEngineMetrics(self, request, context: grpc.ServicerContext):
        entries = []
        for engine in self.router.engines:
            entry = gateway_pb2.EngineMetricsEntry(engine=engine.address, serving=engine.serving,
                                                   in_flight=engine.in_flight)
            try:
                entry.metrics.CopyFrom(engine.info.GetMetrics(engine_info_pb2.GetMetricsRequest(), timeout=5.0,
                                                              metadata=self.router.metadata))
            except grpc.RpcError as e:
                log.warning("engine_metrics_failed", engine=engine.address, code=e.code().name)
            entries.append(entry)
        return gateway_pb2.GetEngineMetricsResponse(engines=entries)
