"""Memory planning before anything is loaded: weights, KV pages (main and MTP), activations, graphs.

Weights are counted on a shard built on the meta device, so a mixture of experts counts every expert's
stacked tensors (quantized ones in their own dtypes) on each rank's slice of their intermediate dimension.

An impossible configuration is refused here with the numbers, never by a crash halfway through
loading (the seed's "silent exit while loading model..." lesson).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engine.config import EngineConfig, ModelConfig
from engine.errors import CapacityError
from engine.platform import KernelPaths, residual_dtype_name
from engine.worker.paged_kv import PREFILL_GATHER_MAX_BYTES, PREFILL_TMA_HEAD_DIMS

GiB = 1 << 30
# On the CPU an automatic capacity stops here: memory there is shared with everything else.
CPU_AUTO_KV_TOKENS = 32768
# What the plan does not count tensor by tensor: the decode graphs' memory pool (sampling and
# sorting buffers of the largest bucket), cuBLAS workspaces, the caching allocator's rounding and
# the CUDA context; with TP also NCCL's buffers, the P2P staging areas and each rank thread's
# handles. Measured on an H200, qwen3-8b, k = 3, batch 16, an 8k prompt (tests/engine/test_engine_gpu.py,
# automatic capacity): 1.8 GiB past a 1 GiB reserve at TP1, 3.6 GiB at TP2 (0.6 GiB of which was
# the plan counting a rank's vocabulary rows at 1/tp of their size, since fixed), hence these.
CUDA_RESERVE_BYTES = 3 * GiB
CUDA_TP_RESERVE_BYTES = 2 * GiB


def dtype_bytes(name: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}[name]


@dataclass(frozen=True)
class MemoryPlan:
    available_bytes: int       # what the engine may use on one device
    weights_bytes: int         # per rank
    activation_bytes: int      # the largest prefill chunk and decode round, with logits
    reserve_bytes: int         # graphs and allocator slack
    kv_bytes_per_token: int    # all KV layers (main + MTP), per rank, scales included
    kv_tokens: int             # the capacity, a whole number of blocks
    num_blocks: int
    # Hybrids: linear-attention state slots (one per batch seat, the prefix-reuse snapshots, plus a
    # scratch slot) and their bytes.
    state_slots: int = 0
    state_bytes_per_slot: int = 0

    @property
    def state_bytes(self) -> int:
        return (self.state_slots + 1) * self.state_bytes_per_slot if self.state_slots else 0

    @property
    def kv_bytes(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token

    def describe(self) -> str:
        g = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        states = (f"state slots {self.state_slots} (seats and snapshots, +1 scratch) x {self.state_bytes_per_slot} B = "
                  f"{g(self.state_bytes)}, " if self.state_slots else "")
        return (f"KV {self.kv_tokens} tokens x {self.kv_bytes_per_token} B = {g(self.kv_bytes)}, {states}weights "
                f"{g(self.weights_bytes)}, activations {g(self.activation_bytes)}, reserve "
                f"{g(self.reserve_bytes)}; available {g(self.available_bytes)}")


def available_memory(cfg: EngineConfig) -> int:
    if cfg.device == "cpu":
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(total * cfg.memory_utilization)
    free, total = torch.cuda.mem_get_info(torch.device(cfg.device))
    used_by_others = total - free
    return int(total * cfg.memory_utilization) - used_by_others


def shard_bytes(model: ModelConfig, tp: int, with_mtp: bool, max_position: int, elt: int) -> int:
    """Bytes of one rank's shard: its parameters in the model dtype (quantized ones in their own) and
    its buffers (the RoPE table), counted on a shard built on the meta device -- exact for whatever each layer splits or keeps
    whole (norms, the MTP fc, KV heads fewer than ranks, padded vocabulary rows)."""
    from engine.models.registry import model_class
    from engine.distributed.tp_group import TPGroup
    with torch.device("meta"):
        shard = model_class(model)(model, TPGroup(rank=0, size=tp), with_mtp=with_mtp, max_position=max_position)
    # quantized layers' tensors (packed codes, scales) keep their own dtype
    return (sum(p.numel() * (p.element_size() if getattr(p, "quantized", False) else elt) for p in shard.parameters())
            + sum(b.numel() * b.element_size() for b in shard.buffers()))


def plan_memory(cfg: EngineConfig, model: ModelConfig, draft_tokens: int, max_model_len: int,
                available: int | None = None, paths: KernelPaths | None = None) -> MemoryPlan:
    """`paths`: the device's kernel families (engine/platform.py); None on CUDA = the sm90 ones (a TMA prefill)."""
    tp = cfg.tensor_parallel_size
    elt = dtype_bytes(cfg.torch_dtype_name)
    kv_elt = dtype_bytes(cfg.kv_dtype_name)
    kv_heads = max(1, model.num_key_value_heads // tp)
    kv_layers = len(model.full_attention_layers) + (model.mtp_num_hidden_layers if draft_tokens > 0 else 0)
    per_token = kv_layers * 2 * kv_heads * model.head_dim * kv_elt
    if cfg.kv_dtype_name == "int8":
        per_token += kv_layers * 2 * kv_heads * 4                   # float32 scale per token and head
    weights = shard_bytes(model, tp, draft_tokens > 0, max_model_len + draft_tokens + 1, elt)
    h, f = model.hidden_size, model.intermediate_size // tp
    qkv = (model.num_attention_heads + 2 * model.num_key_value_heads) * model.head_dim // tp
    chunk = min(cfg.prefill_chunk, max_model_len)
    # live tensors of one layer at the largest chunk (hidden, residual, qkv, attention out, gate/up,
    # act), twice for the allocator's double buffering; plus the vocabulary rows sampled per step.
    activations = 2 * chunk * (4 * h + qkv + 3 * f) * elt
    # the residual stream in and out of a norm, wider than the activations under float16 (engine.layers.norm)
    activations += 2 * chunk * 2 * h * (dtype_bytes(residual_dtype_name(cfg.torch_dtype_name)) - elt)
    if cfg.torch_dtype_name == "float16":       # the SwiGLU product in float32 (engine.layers.mlp)
        activations += 2 * chunk * 4 * f
    if model.is_moe:
        from engine.loading.moe_config import moe_activation_bytes
        activations += 2 * moe_activation_bytes(model, chunk, tp, elt)
    logit_rows = cfg.max_batch * (draft_tokens + 1)
    activations += logit_rows * model.vocab_size * 4 * (4 if draft_tokens else 2)
    # per-request logit options (engine.worker.logit_options): counts and prompt masks of every seat
    from engine.worker.logit_options import LogitOptionPool, option_slots
    activations += LogitOptionPool.bytes_for(option_slots(cfg.max_batch), model.vocab_size)
    tma_prefill = paths is None or paths.attention_prefill == "triton-tma-prefill"
    if cfg.device != "cpu" and model.head_dim in PREFILL_TMA_HEAD_DIMS and tma_prefill:
        # the TMA prefill's gather of 16-bit K/V (int8 pages dequantized too), or a segment and its float32 state
        activations += PREFILL_GATHER_MAX_BYTES * 3 // 2
    reserve = 0 if cfg.device == "cpu" else CUDA_RESERVE_BYTES + (CUDA_TP_RESERVE_BYTES if tp > 1 else 0)
    avail = available_memory(cfg) if available is None else available
    state_slots, state_per_slot = 0, 0
    if model.is_hybrid:
        from engine.loading.hybrid_config import linear_state_bytes, state_slot_counts
        state_slots = sum(state_slot_counts(cfg, model))
        # the conv window keeps the model dtype: count it at float32 (an upper bound, a few KB)
        state_per_slot = linear_state_bytes(model, tp)
    room = avail - weights - activations - reserve - (state_slots + 1) * state_per_slot * (state_slots > 0)
    if cfg.kv_capacity is not None:
        tokens = -(-cfg.kv_capacity // cfg.block_size) * cfg.block_size
    else:
        tokens = max(0, room) // per_token // cfg.block_size * cfg.block_size
        if cfg.device == "cpu":
            tokens = min(tokens, max(CPU_AUTO_KV_TOKENS, max_model_len + draft_tokens)
                         // cfg.block_size * cfg.block_size + cfg.block_size)
    plan = MemoryPlan(avail, weights, activations, reserve, per_token, tokens, tokens // cfg.block_size,
                      state_slots, state_per_slot)
    if tokens < cfg.block_size or plan.kv_bytes > room:
        asked = f"kv_capacity={cfg.kv_capacity}" if cfg.kv_capacity is not None else "an automatic KV capacity"
        raise CapacityError(
            f"{asked} does not fit: needs {plan.describe()} -- {(plan.kv_bytes - room) / GiB:.2f} GiB short. "
            f"Lower kv_capacity, prefill_chunk or max_batch (one state slot per seat on hybrid models), "
            f"use kv_dtype=int8, or add tensor parallelism.")
    return plan
