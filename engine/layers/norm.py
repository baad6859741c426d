"""RMSNorm, optionally fused with the residual add that precedes it, and the dtype of the residual stream.

float16 activations keep the residual stream in float32. The stream is the running sum of every
layer's output, so it is where a model's largest activations live; Qwen-class checkpoints trained in
bfloat16 carry values there beyond float16's +-65504 (Qwen2 in float16 gives NaN from the first layers
on, QwenLM/Qwen3 issues 826 and 868). Summing in float32 and handing each layer its normed input in
float16 is the fix of flash-attention's layer norm (`residual_in_fp32`) and of llama.cpp, which keeps
every activation in float32. The dense MLP hands its output on in float32 too (engine.layers.mlp rescales
its SwiGLU rows); attention's and the Gated DeltaNet's outputs stay float16, so one of those beyond the
range still overflows. bfloat16 and float32 streams stay in their dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.platform import residual_dtype_name

_RESIDUAL_DTYPES = {d: getattr(torch, residual_dtype_name(str(d).removeprefix("torch.")))
                    for d in (torch.float16, torch.bfloat16, torch.float32)}


def residual_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the residual stream of a model whose activations are `dtype` (engine.platform's rule)."""
    return _RESIDUAL_DTYPES.get(dtype, dtype)


def start_residual(x: torch.Tensor) -> torch.Tensor:
    """The residual stream that starts from the first layer's input x [T, hidden] (x itself unless float16)."""
    return x.to(residual_dtype(x.dtype))


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # x: [..., hidden]. With `residual`, returns (norm(x + residual), x + residual): the sum in the
        # residual's dtype, the normed output in the weight's (the model's; x is float32 after a float16 MLP).
        if x.is_cuda:
            from engine.kernels.elementwise.norm_rope import rms_norm
            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        h = x.to(residual.dtype) + residual
        return self._norm(h, self.weight.dtype), h
