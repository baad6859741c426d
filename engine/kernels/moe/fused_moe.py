"""A sparse MoE block's routed part on CUDA: route and sort, two grouped GEMMs, combine (docs/moe.md).

    logits [T, E] --route_and_sort--> ids, weights [T, k] and the slots sorted by expert, padded to BLOCK_M
    x [T, H]  --grouped GEMM (w13, SwiGLU epilogue, rows gathered by slot // k)--> act [T*k, I_rank]
    act       --grouped GEMM (w2)--> y [T*k, H]
    y, weights, shared expert --combine--> out [T, H]

Four launches for a decode or verify round (the routing and the sort are one when the [T, E] tile fits a
program), six for a prefill chunk. Every buffer's size follows from (T, k, E, BLOCK_M) and the used length
stays on the device, so a round is CUDA-graph capturable.

BLOCK_M: at most DECODE_ROWS tokens, BLOCK_M is the tokens rounded up to a power of two (at least 16, the
tensor cores' smallest M): no expert can be chosen by more rows than that, so every chosen expert is one row
block and its weights are read exactly once per round -- batch rows and MTP verify positions that choose the
same expert share the read. Above that (prefill chunks), BLOCK_M = 64 and the padding is under 64 rows per
expert.
"""

from __future__ import annotations

import torch
import triton

from engine.kernels.moe.align import route_and_sort
from engine.kernels.moe.combine import combine
from engine.kernels.moe.grouped_gemm import moe_gemm

DECODE_ROWS = 64
PREFILL_BLOCK_M = 64


def block_m_for(tokens: int) -> int:
    return max(16, triton.next_power_of_2(tokens)) if tokens <= DECODE_ROWS else PREFILL_BLOCK_M


def sparse_moe(x: torch.Tensor, logits: torch.Tensor, experts, top_k: int, renormalize: bool,
               shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, H]; logits: [T, E]; experts: engine.layers.moe_experts.FusedExperts; shared: [T, H] and
    shared_gate: [T, 1] where the block has a shared expert -> [T, H] in x's dtype (this rank's partial)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    T = x.shape[0]
    ids, weights, slots = route_and_sort(logits, top_k, renormalize, block_m_for(T))
    act = torch.empty(T * top_k, experts.intermediate, dtype=x.dtype, device=x.device)
    moe_gemm(x, experts, "w13", slots, act, a_div=top_k)
    y = torch.empty(T * top_k, experts.hidden, dtype=x.dtype, device=x.device)
    moe_gemm(act, experts, "w2", slots, y, a_div=1)
    return combine(y, weights, shared, shared_gate)
