"""EngineInfoService: what the engine serves (model, limits, tokenizer, warm-up) and its metrics snapshot."""

from __future__ import annotations

import hashlib

import grpc

from engine.engine_info import EngineInfo
from ninfer.v1 import engine_info_pb2, engine_info_pb2_grpc
from services.convert import metrics_to_proto
from services.engine_context import EngineContext


def model_info_to_proto(info: EngineInfo) -> engine_info_pb2.ModelInfo:
    w = info.warmup
    return engine_info_pb2.ModelInfo(
        model=info.model, vocab_size=info.vocab_size, max_model_len=info.max_model_len,
        kv_capacity_tokens=info.kv_capacity_tokens, block_size=info.block_size, prefill_chunk=info.prefill_chunk,
        draft_tokens=info.draft_tokens, eos_token_ids=list(info.eos_token_ids),
        tokenizer_json=info.tokenizer_json,
        tokenizer_sha256=hashlib.sha256(info.tokenizer_json.encode()).hexdigest(),
        device=info.device, dtype=info.dtype, kv_dtype=info.kv_dtype,
        tensor_parallel_size=info.tensor_parallel_size, lease_seconds=info.lease_seconds,
        max_num_seqs=info.max_num_seqs, max_pending=info.max_pending, kernel_paths=dict(info.kernel_paths),
        warmup=engine_info_pb2.Warmup(done=w.done, seconds=w.seconds, cuda_graphs=w.cuda_graphs,
                                      graph_buckets=list(w.graph_buckets),
                                      graph_capture_seconds=w.graph_capture_seconds,
                                      no_graphs_reason=w.no_graphs_reason))


class EngineInfoServicer(engine_info_pb2_grpc.EngineInfoServiceServicer):
    def __init__(self, engine: EngineContext):
        self.ctx = engine
        self._model_info: engine_info_pb2.ModelInfo | None = None

    async def GetModelInfo(self, request, context: grpc.aio.ServicerContext):
        with self.ctx.state.admit(during_drain=True):
            if self._model_info is None:              # built once: the tokenizer is large
                self._model_info = model_info_to_proto(self.ctx.info)
            return self._model_info

    async def GetMetrics(self, request, context: grpc.aio.ServicerContext):
        with self.ctx.state.admit(during_drain=True):
            return metrics_to_proto(await self.ctx.engine.metrics_async())
