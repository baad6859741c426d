"""Routing: softmax over all experts in float32, top k, optional renormalisation -- one Triton pass over the
router logits (engine.kernels.moe.reference.route is its twin).

A program holds BLOCK_T tokens' logits [BLOCK_T, BLOCK_E] in registers and picks the k largest by k rounds
of (max, lowest index among equals, mask out): the choice is made on the logits themselves (softmax is
monotone; picking on rounded probabilities could merge two logits a rounding apart), the weights are the
softmax probabilities of the chosen experts, renormalised in float32 when asked. `topk_tile` is shared with
the fused route-and-sort kernel of few tokens (engine.kernels.moe.align).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def topk_tile(x, cols, K: tl.constexpr, KP: tl.constexpr, RENORM: tl.constexpr):
    # x: float32 logits [BT, BE] (-inf where absent); cols: [BE] -> (ids int32 [BT, KP], weights float32 [BT, KP])
    row_max = tl.max(x, 1)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)                  # absent rows: no -inf - -inf
    p = tl.exp(x - row_max[:, None])
    total = tl.sum(p, 1)
    p = p / tl.where(total > 0, total, 1.0)[:, None]
    kcols = tl.arange(0, KP)
    ids = tl.zeros((x.shape[0], KP), dtype=tl.int32)
    weights = tl.zeros((x.shape[0], KP), dtype=tl.float32)
    rest = x
    for j in tl.static_range(K):
        best = tl.max(rest, 1)                                                   # [BT]
        hit = rest == best[:, None]
        idx = tl.min(tl.where(hit, cols[None, :], x.shape[1]), 1)                # lowest index among equals
        chosen = cols[None, :] == idx[:, None]
        w = tl.sum(tl.where(chosen, p, 0.0), 1)
        ids = tl.where(kcols[None, :] == j, idx[:, None], ids)
        weights = tl.where(kcols[None, :] == j, w[:, None], weights)
        rest = tl.where(chosen, float("-inf"), rest)
    if RENORM:
        chosen_sum = tl.sum(weights, 1)
        weights = weights / tl.where(chosen_sum > 0, chosen_sum, 1.0)[:, None]
    return ids, weights


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, w_ptr, T, E, stride_t,
                  K: tl.constexpr, KP: tl.constexpr, RENORM: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    ok = (rows[:, None] < T) & (cols[None, :] < E)
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :], mask=ok,
                other=float("-inf")).to(tl.float32)
    ids, weights = topk_tile(x, cols, K, KP, RENORM)
    kcols = tl.arange(0, KP)
    out = rows[:, None].to(tl.int64) * K + kcols[None, :]
    store_ok = (rows[:, None] < T) & (kcols[None, :] < K)
    tl.store(ids_ptr + out, ids, mask=store_ok)
    tl.store(w_ptr + out, weights, mask=store_ok)


def tile_rows(num_experts: int) -> int:
    """Tokens per program: a [rows, experts] tile of about 4k float32 values."""
    return max(1, min(64, 4096 // triton.next_power_of_2(num_experts)))


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # logits: [T, E] -> ids int32 [T, k], weights float32 [T, k]
    T, E = logits.shape
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    bt = tile_rows(E)
    _route_kernel[(triton.cdiv(T, bt),)](logits, ids, weights, T, E, logits.stride(0), K=top_k,
                                         KP=triton.next_power_of_2(top_k), RENORM=renormalize, BLOCK_T=bt,
                                         BLOCK_E=triton.next_power_of_2(E), num_warps=4)
    return ids, weights
