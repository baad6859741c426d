"""The two RMSNorms of Qwen3.5-class hybrids.

- `ZeroCentredRMSNorm`: the checkpoint stores each weight as an offset w from one and the norm
  scales by (1 + w), in float32 before casting back (decoder norms, q/k norms, the final and the
  MTP norms). Kept as an offset here too: folding 1 + w into a bf16 weight would round it.
- `GatedRMSNorm`: the Gated DeltaNet output norm, per value head, with a plain weight, multiplied
  by SiLU of the output gate z.
On CUDA each is one Triton launch (engine.kernels.elementwise.norm_rope.rms_norm, engine.kernels.elementwise.gated_rms_norm); the
torch code here is their twin.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class ZeroCentredRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # x: [..., hidden]. With `residual`, returns (norm(x + residual), x + residual), as RMSNorm.
        if x.is_cuda:
            from engine.kernels.elementwise.norm_rope import rms_norm
            return rms_norm(x, self.weight, self.eps, residual, zero_centred=True)
        dtype = x.dtype if residual is None else self.weight.dtype     # x is float32 after a float16 MLP
        if residual is not None:
            x = x.to(residual.dtype) + residual          # in the residual's dtype (float32 under float16)
        out = (_rms(x, self.eps) * (1.0 + self.weight.float())).to(dtype)
        return out if residual is None else (out, x)


class GatedRMSNorm(nn.Module):
    def __init__(self, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, head_dim] (any float dtype); z: [T, heads, head_dim] in the model dtype
        if z.is_cuda:
            from engine.kernels.elementwise.gated_rms_norm import gated_rms_norm
            return gated_rms_norm(x, z, self.weight, self.eps)
        dtype = z.dtype
        normed = self.weight * _rms(x, self.eps).to(dtype)
        return (normed * F.silu(z.float())).to(dtype)
