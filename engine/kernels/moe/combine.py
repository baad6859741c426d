"""The weighted combine of a sparse MoE block, in one pass (engine.kernels.moe.reference.experts is its twin):

    out[t] = sum_j w[t, j] * y[t * k + j]  (+ sigmoid(g[t]) * shared[t])      float32, rounded once

y holds each (token, choice)'s expert output (the down GEMM's rows, in slot order), w the routing weights in
float32; the shared expert's output and gate logit are added in the same pass where the block has one. A
program covers BLOCK_T tokens and BLOCK_H features; every slot row is read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _combine_kernel(y_ptr, w_ptr, shared_ptr, gate_ptr, out_ptr, T, H, stride_y, stride_shared, stride_gate,
                    stride_out, K: tl.constexpr, SHARED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rows_ok = rows < T
    ok = rows_ok[:, None] & (cols[None, :] < H)
    r64 = rows.to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(K):
        w = tl.load(w_ptr + r64 * K + j, mask=rows_ok, other=0.0)
        y = tl.load(y_ptr + (r64 * K + j)[:, None] * stride_y + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        acc += w[:, None] * y
    if SHARED:
        g = tl.load(gate_ptr + r64 * stride_gate, mask=rows_ok, other=0.0).to(tl.float32)
        s = tl.load(shared_ptr + r64[:, None] * stride_shared + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        acc += (1.0 / (1.0 + tl.exp(-g)))[:, None] * s
    tl.store(out_ptr + r64[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


def combine(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None = None,
            shared_gate: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    # y: [T*k, H]; weights: float32 [T, k]; shared: [T, H]; shared_gate: [T, 1] -> [T, H]
    T, k = weights.shape
    H = y.shape[1]
    out = torch.empty(T, H, dtype=out_dtype or y.dtype, device=y.device)
    bt, bh = min(16, triton.next_power_of_2(T)), min(256, triton.next_power_of_2(H))
    has_shared = shared is not None
    _combine_kernel[(triton.cdiv(T, bt), triton.cdiv(H, bh))](
        y, weights, shared if has_shared else y, shared_gate if has_shared else y, out, T, H, y.stride(0),
        shared.stride(0) if has_shared else 0, shared_gate.stride(0) if has_shared else 0, out.stride(0),
        K=k, SHARED=has_shared, BLOCK_T=bt, BLOCK_H=bh, num_warps=4)
    return out
