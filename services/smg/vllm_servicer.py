"""vLLM's engine protocol (`vllm.grpc.engine.VllmEngine` from PyPI smg-grpc-proto) over ninfer's engine.

Why this one of smg's engine protocols: smg's gRPC router drives every call of it that a text
engine has (Generate, Abort, HealthCheck, GetModelInfo, GetServerInfo, GetLoads, GetTokenizer,
SubscribeKvEvents, FlushCache: all served here, and Embed for embedding checkpoints; not the profiler calls), while TRT-LLM's
has no GetLoads and SGLang's adds LoRA calls ninfer has no use for; its sampling fields tell "unset"
from zero (`optional temperature`, `max_tokens`, `seed`), which is how our validation reads them;
and its final message carries MTP acceptance (`spec_accepted_tokens`, `spec_draft_tokens`). smg
detects the protocol by trying each one's HealthCheck (SGLang's first, UNIMPLEMENTED here), so
nothing needs configuring.

A Generate is one in-process engine request: the same scheduler, MTP and timings as ninfer.v1; with
`--kv-role producer|consumer` it is one leg of smg's prefill/decode disaggregation (services/smg/pd.py). What the protocol cannot carry (the timings, rates, per-position acceptance)
goes in the trailing metadata `ninfer-request-stats-bin` as a serialized `ninfer.v1.RequestStats`,
and into our spans, `engine_request_done` log and Prometheus metrics as for any request.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

import grpc
import structlog
from structlog.contextvars import bound_contextvars

from engine.cache import kv_landing
from engine.config import EngineConfig
from engine.errors import InvalidArgumentError
from engine.sampling_params import SamplingParams
from engine.request_stats import FinishReason, RequestStats
from services.convert import stats_to_proto, token_ids_from_proto
from services.engine_context import EngineContext
from services.server.errors import RpcAbort
from services.server.prometheus import observe_per_token
from services.smg import convert
from services.smg.engine_port import EnginePort
from services.kv_transfer import handoff as kvh
from services.smg.kv_events import KvEventPublisher
from services.smg.pd import PDRole, complete_with_handoff
from services.smg.tokenizer_bundle import tokenizer_chunks, tokenizer_zip
from services.server.telemetry import stats_attributes
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

log = structlog.get_logger(__name__)
STATS_TRAILER = "ninfer-request-stats-bin"      # a serialized ninfer.v1.RequestStats


def _version() -> str:
    try:
        return metadata.version("ninfer")
    except metadata.PackageNotFoundError:
        return "unknown"


class AbortWhenCallEnds:
    """gRPC done callback: abort the engine request unless it finished (disarmed) first."""

    def __init__(self, port: EnginePort, request_id: str):
        self._port, self._request_id = port, request_id
        self._armed = True
        self._lock = threading.Lock()

    def __call__(self, context: grpc.aio.ServicerContext | None = None) -> None:
        with self._lock:
            armed, self._armed = self._armed, False
        if armed:
            self._port.abort(self._request_id)

    def disarm(self) -> None:
        with self._lock:
            self._armed = False


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, ctx: EngineContext, config: EngineConfig):
        self.ctx = ctx
        self.port = EnginePort(ctx, config)
        self.started = time.time()
        self.last_receive = 0.0
        self.kv_events: KvEventPublisher | None = None
        self._attach_lock = threading.Lock()
        self._bundle: bytes | None = None
        self.pd = PDRole(self.port, config)          # --kv-role producer|consumer (services/smg/pd.py)

    def _engine(self):
        """The engine's facts, once it is loaded; the KV-event listener goes on at the first call."""
        facts = self.port.facts()
        with self._attach_lock:
            if self.kv_events is None:
                publisher = KvEventPublisher(facts.info.block_size)
                self.port.add_kv_listener(publisher)
                self.kv_events = publisher
        if self.pd.active:
            self.pd.agent()                  # the KV pool registered with NIXL before the first leg comes
        return facts

    # -- generation -----------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        ctx = self.ctx
        with ctx.state.admit(), bound_contextvars(request_id=request.request_id or None), \
                ctx.tracer.start_as_current_span("smg.generate") as span:
            self.last_receive = time.time()
            info = self._engine().info
            convert.check_unsupported_inputs(request)
            if request.WhichOneof("input") != "tokenized":
                raise InvalidArgumentError("text", "send token ids (`tokenized`): the router tokenizes")
            prompt = token_ids_from_proto(request.tokenized.input_ids, "tokenized.input_ids", info.vocab_size)
            params = convert.sampling_from_proto(request.sampling_params, len(prompt), info)
            tags = kvh.parse(request.kv_transfer_params_json) if request.HasField("kv_transfer_params_json") else None
            lending = bool(tags and tags.do_remote_decode and self.pd.role == "producer" and params.n == 1)
            pulling = bool(tags and tags.do_remote_prefill and tags.handoff and self.pd.role == "consumer")
            if lending or pulling:
                prompt = self.pd.truncated(prompt, params)     # both legs mean the prompt the producer prefilled
            if lending:
                params = self.pd.prefill_params(params, len(prompt))
                # smg 1.13 gives up on a prefill leg that shows nothing within 3 s of its dispatch (504
                # prefill_worker_silent, "dispatch" then "first_response"): the stream opens now and its first
                # message, an empty chunk, goes out before a long prompt's prefill (smg drains and drops it)
                await context.send_initial_metadata(())
            landing = None
            if pulling:
                # the whole state lands unless the request must compute its prompt (prompt logprobs) or the
                # first token's logprobs
                landing = await self.pd.pull(f"{request.request_id}:{uuid.uuid4().hex[:8]}", prompt, tags.handoff,
                                             kv_landing.lands_whole(params))
            try:
                if landing is not None:
                    stream = await self.port.submit_landed(landing, prompt, params, request.request_id,
                                                           tags.handoff.first_token_id if landing.whole else None)
                else:
                    stream = await self.port.submit(prompt, params, request.request_id, park_after_prefill=lending)
            except InvalidArgumentError as e:               # admission: named as the protocol names it
                raise convert.protocol_error(e) from None
            except asyncio.CancelledError:                  # admitted or not, the landing holds nothing after
                if landing is not None:
                    self.port.drop_landing(landing)
                raise
            guard = AbortWhenCallEnds(self.port, stream.request_id)
            if context.done():                       # the call has ended already
                guard()
            else:
                context.add_done_callback(guard)
            span.set_attribute("ninfer.request_id", stream.request_id)
            if lending:
                async for response in self._lend(stream, guard, len(prompt), span):
                    yield response
                return
            seqs = [_Sequence() for _ in range(params.n)]          # n > 1: one per index
            prompt_lp: list | None = None                            # prompt logprobs, until sent
            wants_lp = params.logprobs is not None
            finals: dict[int, pb.GenerateResponse] = {}            # unary: each sequence's, until all are done
            last = time.monotonic()
            try:
                async for out in stream:
                    now = time.monotonic()
                    seq = seqs[out.index]
                    if out.new_token_ids and seq.output:
                        observe_per_token(ctx.metrics.inter_token, now - last, len(out.new_token_ids))
                    last = now
                    seq.output.extend(out.new_token_ids)
                    seq.logprobs.extend(out.logprobs or ())
                    if out.prompt_logprobs is not None:
                        prompt_lp = out.prompt_logprobs
                    if not out.finished:
                        if request.stream and (out.new_token_ids or prompt_lp is not None):
                            yield convert.chunk(out.new_token_ids, len(prompt), len(seq.output), index=out.index,
                                                logprobs=out.logprobs if wants_lp else None, prompt_ids=prompt,
                                                prompt_logprobs=prompt_lp)
                            prompt_lp = None
                        continue
                    self._report(out.stats, span)
                    if out.finish_reason is FinishReason.ABORT:        # Abort rpc, or the call ended: no one listens
                        guard.disarm()
                        raise RpcAbort(grpc.StatusCode.CANCELLED, f"request {stream.request_id!r} was aborted")
                    if stream.finished:
                        guard.disarm()
                        context.set_trailing_metadata(((STATS_TRAILER, stats_to_proto(out.stats).SerializeToString()),))
                    matched = _matched_stop_token(out.stats, seq.output, params, info.eos_token_ids)
                    if request.stream:
                        if out.new_token_ids or prompt_lp is not None:
                            yield convert.chunk(out.new_token_ids, len(prompt), len(seq.output),
                                                out.stats.usage.cached_tokens, index=out.index,
                                                logprobs=out.logprobs if wants_lp else None, prompt_ids=prompt,
                                                prompt_logprobs=prompt_lp)
                            prompt_lp = None
                        yield convert.complete([], out.stats, matched, index=out.index)
                    else:
                        # unary: every sequence's answer once all have finished, in index order (smg 1.13
                        # numbers a unary request's choices in the order the answers arrive)
                        finals[out.index] = convert.complete(
                            seq.output, out.stats, matched, index=out.index, logprobs=seq.logprobs if wants_lp else None,
                            prompt_ids=prompt, prompt_logprobs=prompt_lp)
                        prompt_lp = None
                        if stream.finished:
                            for i in sorted(finals):
                                yield finals[i]
            except (GeneratorExit, asyncio.CancelledError):   # the call ended: the client is gone
                if not stream.finished:
                    guard()
                raise

    async def _lend(self, stream, guard: "AbortWhenCallEnds", prompt_len: int, span):
        """A producer's prefill leg: its first token and the hand-off; the request stays parked for the
        consumer (the call's end no longer aborts it: the consumer's notification or the lease frees it)."""
        yield convert.chunk([], prompt_len, 0)
        out = await stream.next_async()
        if out.finished:
            self._report(out.stats, span)
            guard.disarm()
            if out.finish_reason is FinishReason.ABORT:
                raise RpcAbort(grpc.StatusCode.CANCELLED, f"request {stream.request_id!r} was aborted")
            yield convert.complete(out.new_token_ids, out.stats, None)
            return
        guard.disarm()
        self.ctx.metrics.observe_prefill(out.stats)
        handoff_json = await self.pd.lend(stream.request_id, prompt_len)
        yield complete_with_handoff(convert.complete(out.new_token_ids, out.stats, None), handoff_json)

    def _report(self, stats: RequestStats, span) -> None:
        span.set_attributes(stats_attributes(stats))
        self.ctx.metrics.observe_prefill(stats)
        self.ctx.metrics.observe_finished(stats)
        log.info("engine_request_done", protocol="vllm.grpc.engine", **stats_attributes(stats))

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext):
        """An embedding checkpoint's vector of the prompt (last-token pooling, L2-normalised, as
        Qwen3-Embedding); UNIMPLEMENTED for a generative model (engine.loading.pooling)."""
        with self.ctx.state.admit(), bound_contextvars(request_id=request.request_id or None):
            info = self._engine().info
            prompt = token_ids_from_proto(request.tokenized.input_ids, "tokenized.input_ids", info.vocab_size)
            stream = await self.port.embed(prompt, request.request_id)
            guard = AbortWhenCallEnds(self.port, stream.request_id)
            if context.done():                       # the call has ended already
                guard()
            else:
                context.add_done_callback(guard)
            out = None
            async for out in stream:
                pass
            guard.disarm()
            if out is None or out.embedding is None:
                raise RpcAbort(grpc.StatusCode.CANCELLED, f"request {stream.request_id!r} was aborted")
            return pb.EmbedResponse(embedding=out.embedding, prompt_tokens=len(prompt),
                                    embedding_dim=len(out.embedding))

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext):
        with self.ctx.state.admit(during_drain=True):
            for request_id in request.request_ids:
                self.port.abort(request_id)
            return pb.AbortResponse()

    async def FlushCache(self, request, context: grpc.aio.ServicerContext):
        """Drop the prefix cache at once (`timeout_s` is moot: blocks in use are never dropped)."""
        with self.ctx.state.admit(during_drain=True):
            self._engine()
            self.port.flush_prefix_cache()
            return common_pb2.FlushCacheResponse(success=True, message="prefix cache flushed")

    # -- state ----------------------------------------------------------------------------------

    async def HealthCheck(self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext):
        """UNAVAILABLE until the engine serves (smg retries its registration instead of registering an
        engine whose model it cannot learn yet); healthy=false while draining."""
        state = self.ctx.state
        if state.draining:
            return pb.HealthCheckResponse(healthy=False, message="draining")
        state.check_admission()
        self._engine()
        return pb.HealthCheckResponse(healthy=True, message="serving")

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext):
        with self.ctx.state.admit(during_drain=True):
            facts = self._engine()
            return convert.model_info(facts, _hf_config(facts.model_dir))

    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext):
        with self.ctx.state.admit(during_drain=True):
            facts = self._engine()
            info = facts.info
            return pb.GetServerInfoResponse(
                active_requests=convert.active_requests(await self.port.metrics()), is_paused=self.ctx.state.draining,
                last_receive_timestamp=self.last_receive, uptime_seconds=time.time() - self.started,
                server_type="ninfer-grpc", data_parallel_size=1, kv_cache_dtype=info.kv_dtype,
                block_size=info.block_size, model_dtype=info.dtype, max_num_seqs=facts.max_batch,
                **self.pd.server_info())

    async def GetLoads(self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext):
        with self.ctx.state.admit(during_drain=True):
            if request.HasField("dp_rank") and request.dp_rank != 0:
                raise InvalidArgumentError("dp_rank", f"this engine has one rank (0), got {request.dp_rank}")
            return convert.loads(await self.port.metrics(), self._engine(), _version())

    async def GetTokenizer(self, request, context: grpc.aio.ServicerContext):
        with self.ctx.state.admit(during_drain=True):
            facts = self._engine()
            if self._bundle is None:
                self._bundle = tokenizer_zip(facts.model_dir, facts.info.tokenizer_json)
            for chunk in tokenizer_chunks(self._bundle):
                yield chunk

    async def SubscribeKvEvents(self, request, context: grpc.aio.ServicerContext):
        """Not counted in flight: a subscription lives as long as the router; it ends on drain."""
        state = self.ctx.state
        state.check_admission(during_drain=False)
        self._engine()
        await context.send_initial_metadata(())      # smg waits 2 s for the stream to open, not for an event
        async for batch in self.kv_events.subscribe(request.start_sequence_number,
                                                    wanted=lambda: not context.done() and not state.draining):
            yield batch


class _Sequence:
    """One of a request's n sequences as the stream delivers it."""

    def __init__(self) -> None:
        self.output: list[int] = []
        self.logprobs: list = []


def _matched_stop_token(stats: RequestStats, output: list[int], params: SamplingParams,
                        eos: tuple[int, ...]) -> int | None:
    """The token that stopped the request, when one did (a stop string is not reported)."""
    if stats.finish_reason is not FinishReason.STOP or not output:
        return None
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    return output[-1] if output[-1] in stop_ids else None


def _hf_config(model_dir: str | None) -> dict[str, Any]:
    path = Path(model_dir) / "config.json" if model_dir else None
    if path is None or not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
