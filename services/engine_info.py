"""EngineInfoService: what the engine serves (model, limits, tokenizer) and its metrics snapshot."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import grpc

from engine.core import EngineCore
from ninfer.v1 import engine_info_pb2, engine_info_pb2_grpc
from services.convert import metrics_to_proto

if TYPE_CHECKING:
    from services.engine_host import EngineHost


def model_info(core: EngineCore, lease_seconds: float) -> engine_info_pb2.ModelInfo:
    d = core.describe()
    tokenizer_json = core.tokenizer.inner.to_str()
    return engine_info_pb2.ModelInfo(
        model=d["model"], vocab_size=core.model_config.vocab_size, max_model_len=d["max_model_len"],
        kv_capacity_tokens=d["kv_capacity_tokens"], block_size=d["block_size"], prefill_chunk=d["prefill_chunk"],
        draft_tokens=d["draft_tokens"], eos_token_ids=list(core.model_config.eos_token_ids),
        tokenizer_json=tokenizer_json, tokenizer_sha256=hashlib.sha256(tokenizer_json.encode()).hexdigest(),
        device=d["device"], dtype=d["dtype"], kv_dtype=d["kv_dtype"],
        tensor_parallel_size=d["tensor_parallel_size"], lease_seconds=lease_seconds)


class EngineInfoServicer(engine_info_pb2_grpc.EngineInfoServiceServicer):
    def __init__(self, host: "EngineHost"):
        self.host = host

    def GetModelInfo(self, request, context: grpc.ServicerContext):
        with self.host.state.admit(during_drain=True):
            return self.host.model_info

    def GetMetrics(self, request, context: grpc.ServicerContext):
        with self.host.state.admit(during_drain=True):
            snapshot, refs = self.host.loop.call(lambda core: (core.snapshot(), (core.kv.refs_taken, core.kv.refs_dropped)))
            return metrics_to_proto(snapshot, refs)
