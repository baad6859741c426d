"""SwiGLU activation over a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, 2 * ffn] (gate then up) -> [T, ffn]
        if x.is_cuda:
            from engine.kernels.elementwise.norm_rope import silu_and_mul
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
