"""The two RMSNorms of Qwen3.5-class hybrids on CUDA, one launch each (their torch twins are
`engine.layers.hybrid_norm`, and each kernel rounds where its twin rounds):

  zero_centred_rms_norm  x (+ residual) normalised, times (1 + w) in float32, rounded once
  gated_rms_norm         per value head: the normalised x rounded, times w (rounded), times SiLU(z)

Grids depend on shapes only (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _zero_centred_kernel(x_ptr, r_ptr, w_ptr, o_ptr, ro_ptr, stride_x, stride_r, stride_o, stride_ro, n, eps,
                         BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    dt = o_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # the twin adds in the activation dtype: round the sum before it is stored and normed
        x = (x + tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)).to(dt)
        tl.store(ro_ptr + row * stride_ro + offs, x, mask=mask)
        x = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / n + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * stride_o + offs, (x * r * (1.0 + w)).to(dt), mask=mask)


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x, residual: [..., hidden]; weight: [hidden] (the offset from one). Without residual: norm(x);
    with it: (norm(x + residual), x + residual)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o2 = out.view(-1, n)
    if residual is not None:
        r2 = residual.reshape(-1, n)
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        ro2 = residual_out.view(-1, n)
    else:
        r2 = ro2 = x2                                   # placeholders, never touched
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _zero_centred_kernel[(x2.shape[0],)](x2, r2, weight, o2, ro2, x2.stride(0), r2.stride(0), o2.stride(0),
                                             ro2.stride(0), n, eps, BLOCK=block, HAS_RESIDUAL=residual is not None,
                                             num_warps=min(16, max(1, block // 512)))
    return out if residual is None else (out, residual_out)


@triton.jit
def _gated_kernel(x_ptr, z_ptr, w_ptr, o_ptr, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    dt = o_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    xn = (x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)).to(dt).to(tl.float32)
    normed = (tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) * xn).to(w_ptr.dtype.element_ty)
    z = tl.load(z_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * D + offs, (normed.to(tl.float32) * (z / (1.0 + tl.exp(-z)))).to(dt), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H, D] (any float dtype); z: [T, H, D]; weight: [D] -> [T, H, D] in z's dtype."""
    D = x.shape[-1]
    x2, z2 = x.reshape(-1, D).contiguous(), z.reshape(-1, D).contiguous()
    out = torch.empty(z2.shape, dtype=z.dtype, device=z.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(D)
        _gated_kernel[(x2.shape[0],)](x2, z2, weight, out, D, eps, BLOCK=block, num_warps=1 if block <= 256 else 4)
    return out.view(z.shape)
