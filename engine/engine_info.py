"""What an engine serves and how it was readied: the typed answer of the engine's front door to
"what are you". No torch: the services and the gateway read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WarmupReport:
    """What the warm-up did before the engine reported SERVING."""

    done: bool
    seconds: float = 0.0
    cuda_graphs: bool = False
    graph_buckets: tuple[int, ...] = ()          # decode batch sizes captured
    graph_capture_seconds: float = 0.0
    no_graphs_reason: str = ""                   # why no graphs were captured (CPU, --enforce-eager)

    def log_fields(self) -> dict[str, Any]:
        return {"warmup_seconds": round(self.seconds, 3), "cuda_graphs": self.cuda_graphs,
                "graph_buckets": list(self.graph_buckets),
                "graph_capture_seconds": round(self.graph_capture_seconds, 3),
                **({"no_graphs_reason": self.no_graphs_reason} if self.no_graphs_reason else {})}


@dataclass(frozen=True)
class EngineInfo:
    model: str
    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int
    block_size: int
    prefill_chunk: int
    draft_tokens: int
    eos_token_ids: tuple[int, ...]
    tokenizer_json: str
    device: str
    dtype: str
    kv_dtype: str
    tensor_parallel_size: int
    lease_seconds: float
    warmup: WarmupReport
    max_num_seqs: int = 0                    # the decode batch (--max-num-seqs)
    max_pending: int = 0                     # the queue (--max-pending)
    kernel_paths: tuple[tuple[str, str], ...] = ()   # operation -> kernel family (engine/platform.py)
    embedding: bool = False                  # an embedding checkpoint (engine.loading.pooling): Embed serves

    def log_fields(self) -> dict[str, Any]:
        """Everything but the tokenizer, for a log line."""
        return {"model": self.model, "device": self.device, "dtype": self.dtype, "kv_dtype": self.kv_dtype,
                "draft_tokens": self.draft_tokens, "prefill_chunk": self.prefill_chunk,
                "max_model_len": self.max_model_len, "kv_capacity_tokens": self.kv_capacity_tokens,
                "block_size": self.block_size, "tensor_parallel_size": self.tensor_parallel_size,
                "kernel_paths": dict(self.kernel_paths),
                **self.warmup.log_fields()}
