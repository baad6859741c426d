"""Gateway.Generate: one client stream = a Prefill call and a Decode stream on one engine (or, when
that engine is lost mid-stream, a resume on another: gateway.migration).

    client --Generate--> [validate, tokenize] --Prefill(ids)--> engine: handle, first token
                         [detokenize]         --Decode(handle)--> engine: tokens ... final stats

The client's deadline goes to both calls (what is left of it); a client that goes away cancels the
engine call in flight (the engine aborts within one step). The gateway owns the handle (= its request
id) from the Prefill call until the Decode stream's first message proves the engine attached it: a
Prefill or Decode call that fails in between is followed by a Release (NOT_FOUND is fine), so that no
handle waits for its lease.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import structlog
from opentelemetry.trace import Tracer
from structlog.contextvars import bound_contextvars

from ninfer.v1 import common_pb2, decode_pb2, engine_info_pb2, gateway_pb2, gateway_pb2_grpc, prefill_pb2
from services.convert import stats_from_proto
from services.server.errors import SHUT_DOWN_DETAILS, RpcAbort, status_for
from services.server.lifecycle import ServingState
from services.server.prometheus import GatewayPrometheus
from gateway.calls import CallCanceller, client_left, past_deadline, time_left
from gateway.client_spans import client_span
from gateway.migration import EngineLost, MigrationPolicy, StallWatch, StreamProgress, lost_by_status
from gateway.prepare import prepare_off_loop
from gateway.report import RequestRecord, report
from gateway.router import Engine, EngineRouter
from gateway.text import StreamingText

log = structlog.get_logger(__name__)
RELEASE_TIMEOUT_S = 5.0


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, router: EngineRouter, state: ServingState, tracer: Tracer, metrics: GatewayPrometheus,
                 policy: MigrationPolicy = MigrationPolicy()):
        self.router = router
        self.policy = policy
        self.state = state
        self.tracer = tracer
        self.metrics = metrics
        self._background: set[asyncio.Task] = set()

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        record = RequestRecord(request_id=uuid.uuid4().hex, received=time.monotonic())
        with bound_contextvars(request_id=record.request_id), \
                self.tracer.start_as_current_span("generate") as span:
            canceller = CallCanceller()
            try:
                with self.state.admit(), self.state.on_cut(canceller):
                    async for response in self._generate(request, context, record, canceller):
                        yield response
                record.status = grpc.StatusCode.OK
            except BaseException as e:        # GeneratorExit, CancelledError too: the client went away
                if self.state.shut_down and not client_left(e, context):
                    record.status = grpc.StatusCode.UNAVAILABLE          # cut at the drain timeout
                    raise RpcAbort(grpc.StatusCode.UNAVAILABLE, SHUT_DOWN_DETAILS) from e
                record.status = status_for(e, 0).code
                if record.status is grpc.StatusCode.CANCELLED and past_deadline(context):
                    record.status = grpc.StatusCode.DEADLINE_EXCEEDED     # what the client saw
                raise
            finally:
                report(record, span, self.metrics)

    async def _generate(self, request: gateway_pb2.GenerateRequest, context, record: RequestRecord,
                        canceller: CallCanceller):
        model = self.router.model
        if model is None:
            raise RpcAbort(grpc.StatusCode.UNAVAILABLE, "no engine has reported its model yet")
        record.model = model.info.model
        record.sampling = request.sampling
        prepared = await prepare_off_loop(request, model, wait_s=time_left(context))
        params = prepared.params
        record.operation, record.prompt_tokens = prepared.operation, len(prepared.prompt_ids)
        record.tokenize_s = time.monotonic() - record.received
        texts = [StreamingText(model.tokenizer, prepared.prompt_ids, params.stop, params.include_stop_str_in_output,
                               params.min_tokens, params.skip_special_tokens, params.spaces_between_special_tokens)
                 for _ in range(params.n)]
        if context.done():
            raise RpcAbort(grpc.StatusCode.CANCELLED, "the client went away")
        context.add_done_callback(canceller)
        progress = StreamProgress(list(prepared.prompt_ids))
        engine, first = await self._prefill(request, progress, context, record, canceller)
        record.engine = engine.address
        progress.seed = first.seed
        opts = request.stream_options
        usage = first.stats.usage
        sequences = list(first.sequences) or [common_pb2.SequenceOutput(
            index=0, token_ids=first.token_ids, finished=first.finished, stats=first.stats, logprobs=first.logprobs)]
        unfinished = [params.n - sum(seq.finished for seq in sequences)]
        handle = first.handle
        if not first.finished:                     # every sequence finished: no handle waits
            canceller.own(lambda: self._release_handle(engine, handle))     # no decode has attached it yet
        # The first tokens go out before the decode call starts: starting a gRPC call costs about a
        # millisecond of Python, which would otherwise add to the time to first token.
        try:
            prompt_logprobs = first.prompt_logprobs
            for seq in sequences:
                if seq.index == 0:
                    progress.sent += seq.token_ids
                reply = self._message(record, texts[seq.index], seq, usage, opts, prompt_logprobs)
                prompt_logprobs = ()
                if reply is not None:
                    yield reply
        except BaseException:                      # the client left: _decode will not run to free these
            self.router.release(engine)
            canceller.release_owned()
            raise
        if first.finished:
            self.router.release(engine)
            return
        while True:
            try:
                async for response in self._decode(engine, handle, context, record, canceller, texts, usage, opts,
                                                   progress, unfinished):
                    yield response
                return
            except EngineLost as lost:
                if params.n > 1:                   # a stream of several sequences ends with the error
                    raise lost.error from None
                engine, handle = await self._migrate(request, lost, engine, context, record, canceller, progress)

    async def _decode(self, engine: Engine, handle: str, context, record: RequestRecord, canceller: CallCanceller,
                      texts: list[StreamingText], usage: common_pb2.Usage, opts: gateway_pb2.StreamOptions,
                      progress: StreamProgress, unfinished: list[int]):
        """Stream a prefilled handle's tokens (every sequence's) to the client; EngineLost when its engine is
        lost. `unfinished`: the sequences not finished yet, counted down here."""
        canceller.own(lambda: self._release_handle(engine, handle))   # until the engine attaches it
        try:
            if context.done():
                raise RpcAbort(grpc.StatusCode.CANCELLED, "the client went away after the prefill")
            with client_span(self.tracer, "ninfer.v1.DecodeService", "Decode") as (_, trace_metadata):
                call = engine.decode.Decode(decode_pb2.DecodeRequest(handle=handle), timeout=time_left(context),
                                            metadata=(*self.router.metadata, *trace_metadata))
                canceller.watch(call)
                with StallWatch(engine, self.policy, call) as watch:
                    try:
                        async for msg in call:     # read to the stream's end, so that it ends OK, not cancelled
                            watch.beat()
                            canceller.own(None)    # a message: the engine attached the handle, the stream owns it
                            if msg.index == 0:
                                progress.sent += msg.token_ids
                            reply = self._message(record, texts[msg.index], msg, usage, opts, ())
                            unfinished[0] -= msg.finished
                            if reply is not None:
                                yield reply
                    except asyncio.CancelledError:
                        if watch.lost:
                            raise EngineLost(watch.lost, RpcAbort(
                                grpc.StatusCode.UNAVAILABLE, f"engine {engine.address} stopped answering")) from None
                        raise
                    except grpc.RpcError as e:
                        reason = lost_by_status(e)
                        if reason is not None:
                            raise EngineLost(reason, e) from None
                        raise
            if unfinished[0]:
                raise EngineLost("ended_early", RpcAbort(grpc.StatusCode.UNAVAILABLE,
                                                         f"engine {engine.address} ended the stream early"))
        finally:
            self.router.release(engine)
            canceller.release_owned()

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

    async def _migrate(self, request, lost: EngineLost, engine: Engine, context, record: RequestRecord,
                       canceller: CallCanceller, progress: StreamProgress) -> tuple[Engine, str]:
        """Resume the stream on another engine (gateway.migration); the lost stream's error when it cannot."""
        progress.lost_engines.append(engine)
        if progress.migrations >= self.policy.max_migrations or self.state.shut_down or context.done():
            raise lost.error
        if lost.reason != "no_seat":                 # a full engine is not a lost one
            self.router.mark_unavailable(engine, f"down ({lost.reason})")
        log.warning("stream_migrating", engine=engine.address, reason=lost.reason, tokens_sent=len(progress.sent),
                    migration=progress.migrations + 1)
        try:
            new_engine, resumed = await self._prefill(request, progress, context, record, canceller,
                                                      resume=True)
        except RpcAbort as e:
            if e.code is grpc.StatusCode.UNAVAILABLE:    # no other engine serves: the error it had
                raise lost.error from None
            raise
        progress.migrations += 1
        record.migrations = progress.migrations
        record.engine = new_engine.address
        self.metrics.migrations.labels(reason=lost.reason).inc()
        return new_engine, resumed.handle

    async def _prefill(self, request, progress: StreamProgress, context, record: RequestRecord,
                       canceller: CallCanceller, resume: bool = False) -> tuple[Engine, prefill_pb2.PrefillResponse]:
        """Prefill on the least-loaded engine (for a resume: the prompt and the tokens sent, with the
        stream's seed, on an engine that did not lose it). An engine that turns out UNAVAILABLE (down,
        draining), or that stops answering while the call waits, is skipped for the next one, since
        nothing was sent to the client from there."""
        tried: tuple[Engine, ...] = tuple(progress.lost_engines)
        message = prefill_pb2.PrefillRequest(request_id=record.request_id, prompt_token_ids=progress.prompt_ids,
                                             sampling=request.sampling)
        if resume:
            message.request_id = f"{record.request_id}-m{progress.migrations + 1}"
            message.output_token_ids.extend(progress.sent)
            if not message.sampling.HasField("seed"):
                message.sampling.seed = progress.seed
        while True:
            timeout = time_left(context)          # before the engine's count is taken: it may raise
            engine = self.router.acquire(exclude=tried)
            start = time.monotonic()
            try:
                with client_span(self.tracer, "ninfer.v1.PrefillService", "Prefill") as (_, trace_metadata):
                    call = engine.prefill.Prefill(message, timeout=timeout,
                                                  metadata=(*self.router.metadata, *trace_metadata))
                    canceller.watch(call)
                    with StallWatch(engine, self.policy, call) as watch:
                        try:
                            response = await call
                        except asyncio.CancelledError:
                            if watch.lost is None:
                                raise
                            raise RpcAbort(grpc.StatusCode.UNAVAILABLE, "stopped answering") from None
            except (grpc.RpcError, RpcAbort) as e:
                self.router.release(engine)
                code = e.code() if isinstance(e, grpc.RpcError) else e.code
                if code is grpc.StatusCode.UNAVAILABLE and not context.done():
                    self.router.mark_unavailable(engine)
                    tried += (engine,)
                    log.warning("engine_unavailable", engine=engine.address,
                                details=e.details() if isinstance(e, grpc.RpcError) else e.details)
                    self._release_handle(engine, message.request_id)    # in case it parked it before it hung
                    continue
                if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                    # the engine may have parked it as the call ended: its response was lost
                    self._release_handle(engine, message.request_id)
                raise
            except BaseException:
                self.router.release(engine)
                self._release_handle(engine, message.request_id)
                raise
            record.prefill_call_s += time.monotonic() - start
            return engine, response

    def _release_handle(self, engine: Engine, handle: str) -> None:
        """Release without waiting for the answer: NOT_FOUND (attached, finished or never parked) is
        the usual one; anything else is logged (the lease frees the handle then)."""
        task = asyncio.get_running_loop().create_task(self._release(engine, handle))
        self._background.add(task)                 # the loop keeps only a weak reference to a task
        task.add_done_callback(self._background.discard)

    async def _release(self, engine: Engine, handle: str) -> None:
        try:
            await engine.prefill.Release(prefill_pb2.ReleaseRequest(handle=handle), timeout=RELEASE_TIMEOUT_S,
                                         metadata=self.router.metadata)
        except grpc.RpcError as e:
            if e.code() is not grpc.StatusCode.NOT_FOUND:
                log.warning("release_failed", engine=engine.address, handle=handle, code=e.code().name,
                            details=e.details())

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
                                                   model=record.model, engine=record.engine,
                                                   migrations=record.migrations)
        msg = gateway_pb2.GenerateResponse(request_id=record.request_id, text=text, usage=stats.usage,
                                           result=record.result, index=seq.index, logprobs=seq.logprobs,
                                           prompt_logprobs=prompt_logprobs)
        if opts.include_token_ids:
            msg.token_ids.extend(seq.token_ids)
        return msg

    async def GetEngineMetrics(self, request, context: grpc.aio.ServicerContext):
        async def entry(engine: Engine) -> gateway_pb2.EngineMetricsEntry:
            e = gateway_pb2.EngineMetricsEntry(engine=engine.address, serving=engine.serving,
                                               in_flight=engine.in_flight)
            try:
                e.metrics.CopyFrom(await engine.info.GetMetrics(engine_info_pb2.GetMetricsRequest(), timeout=5.0,
                                                                metadata=self.router.metadata))
            except grpc.RpcError as err:
                log.warning("engine_metrics_failed", engine=engine.address, code=err.code().name)
            return e
        return gateway_pb2.GetEngineMetricsResponse(engines=await asyncio.gather(*map(entry, self.router.engines)))
