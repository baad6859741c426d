"""One layer's paged KV cache: the tensors the attention layer writes and the kernels read."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerKV:
    """One layer's KV pages. int8 pages carry a float32 scale per token and KV head."""

    k: torch.Tensor                        # [num_blocks, block_size, kv_heads, head_dim]
    v: torch.Tensor                        # [num_blocks, block_size, kv_heads, head_dim]
    k_scale: torch.Tensor | None = None    # [num_blocks, block_size, kv_heads] when int8
    v_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.k.dtype == torch.int8
