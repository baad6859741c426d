"""Rotary position embedding, rotate-half convention (as Qwen3 and Hugging Face apply it)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)                             # [max_position, head_dim / 2]
        # cos and sin side by side, float32: [max_position, head_dim]
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], -1).float(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions: [T]; q: [T, heads, head_dim]; k: [T, kv_heads, head_dim]
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)   # [T, 1, head_dim / 2]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
