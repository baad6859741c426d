"""A sparse MoE block's routed part in plain torch: the CPU path, and the yardstick of the Triton kernels.

    probs        = softmax(router_logits.float())              over all E experts, float32
    w, ids       = top_k(probs)                                 (renormalised to sum 1 when asked)
    act[t, j]    = silu(gate_e x_t) * up_e x_t                  e = ids[t, j]; float32 sums, rounded to the model dtype
    y[t, j]      = down_e act[t, j]                             float32 sums, rounded to the model dtype
    out[t]       = sum_j w[t, j] y[t, j] (+ sigmoid(g_t) s_t)   float32, rounded once; s = the shared expert

The roundings are the kernels' (engine.kernels.moe.fused_moe): each GEMM accumulates in float32 and
stores its output in the model dtype; the combine weighs and sums in float32. transformers rounds
`w` to the model dtype and sums in it: equal in float32, a last bit apart in bf16.

Slot s = t * k + j is the j-th choice of token t. `align` is the counting sort the kernels use: slots
grouped by expert (ascending, a stable order inside an expert), each expert's group padded to a multiple
of `block_m` with the sentinel T * k, so every block of rows belongs to one expert.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # logits: [T, E] model dtype -> ids int32 [T, k] (descending weight), weights float32 [T, k]
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids.to(torch.int32), weights


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """ids [T, k] -> (sorted_ids [used] int32: slot ids by expert, padded with T*k; expert_ids [used / block_m]
    int32; used = sum over experts of their slot count rounded up to block_m)."""
    flat = ids.flatten().long()
    sentinel = flat.numel()
    sorted_ids, expert_ids = [], []
    for e in range(num_experts):
        slots = (flat == e).nonzero().flatten()
        padded = -(-slots.numel() // block_m) * block_m
        sorted_ids.append(F.pad(slots, (0, padded - slots.numel()), value=sentinel))
        expert_ids += [e] * (padded // block_m)
    out = torch.cat(sorted_ids).to(torch.int32)
    return out, torch.tensor(expert_ids, dtype=torch.int32), out.numel()


def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            expert_weights: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
            shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, H]; ids, weights: [T, k]; expert_weights(e) -> (w13 [2I, H], w2 [H, I]) of expert e (any float
    dtype, gate rows first); shared: [T, H] the shared expert's output, shared_gate: [T, 1] its gate logit
    -> [T, H] in x's dtype."""
    T, k = ids.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    flat_ids, flat_w = ids.flatten().long(), weights.flatten().float()
    for e in flat_ids.unique().tolist():
        slots = (flat_ids == e).nonzero().flatten()
        tokens = slots // k
        w13, w2 = expert_weights(e)
        gate_up = F.linear(x[tokens].float(), w13.float())                       # [n, 2I] float32
        gate, up = gate_up.chunk(2, dim=-1)
        act = (F.silu(gate) * up).to(x.dtype)
        y = F.linear(act.float(), w2.float()).to(x.dtype)                        # [n, H]
        out.index_add_(0, tokens, y.float() * flat_w[slots, None])
    if shared is not None:
        out += torch.sigmoid(shared_gate.float()) * shared.float()
    return out.to(x.dtype)
