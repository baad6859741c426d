"""GatedRMSNorm of the Qwen3.5-class hybrids on CUDA in one launch (its torch twin is
`engine.layers.hybrid_norm.GatedRMSNorm`, and the kernel rounds where the twin rounds): per value
head, the normalised x rounded, times w (rounded), times SiLU(z). The zero-centred RMSNorm is
`engine.kernels.elementwise.norm_rope.rms_norm(..., zero_centred=True)`. Grids depend on shapes only (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import pdl

@triton.jit
def _gated_kernel(x_ptr, z_ptr, w_ptr, o_ptr, D, eps, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    dt = o_ptr.dtype.element_ty
    pdl.wait_for_inputs(USE_PDL)
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
        _gated_kernel[(x2.shape[0],)](x2, z2, weight, out, D, eps, BLOCK=block, num_warps=1 if block <= 256 else 4,
                                      **pdl.launch_options(z.device))
    return out.view(z.shape)
