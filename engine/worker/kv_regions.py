"""Where the KV pool's blocks sit in memory, for a transfer engine (prefill/decode disaggregation).

The pool is one tensor for all layers (`model_runner.allocate_kv`: [layers, 2, blocks, block_size,
kv_heads, head_dim], plus a float32 scale tensor when int8), so a block of one layer's K or V is one
contiguous span: `base + block_id * stride`. A transfer engine registers the pool's storages once
(`regions`) and moves block lists as (address, bytes) spans.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.worker.paged_kv import LayerKV


@dataclass(frozen=True)
class BlockSpan:
    """One layer's K (or V, or a scale) pages: block b is `bytes_per_block` bytes at `base + b * stride`."""

    base: int
    stride: int
    bytes_per_block: int


@dataclass(frozen=True)
class KVPoolLayout:
    regions: list[tuple[int, int]]        # (address, bytes) of each storage to register, once
    spans: list[BlockSpan]                # per layer: K, V (and their scales when int8), in layer order
    device_type: str                      # "cpu" or "cuda"
    device_id: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every layer (what one block of a prompt costs to move)."""
        return sum(s.bytes_per_block for s in self.spans)

    def shape(self) -> list[int]:
        """Bytes per block of each span: two engines can exchange blocks only when these agree."""
        return [s.bytes_per_block for s in self.spans]

    def block_descs(self, block_ids: list[int]) -> list[tuple[int, int]]:
        """(address, bytes) of each span of each block, span-major (the same order on both sides)."""
        return [(s.base + b * s.stride, s.bytes_per_block) for s in self.spans for b in block_ids]


def kv_pool_layout(kv: list[LayerKV]) -> KVPoolLayout:
    tensors = [t for layer in kv for t in (layer.k, layer.v, layer.k_scale, layer.v_scale) if t is not None]
    regions: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        regions[storage.data_ptr()] = storage.nbytes()
    spans = [BlockSpan(t.data_ptr(), t.stride(0) * t.element_size(), t[0].numel() * t.element_size())
             for t in tensors]
    if any(not t[0].is_contiguous() for t in tensors):
        raise RuntimeError("a KV block is not contiguous in the pool: it cannot move as one span")
    device: torch.device = tensors[0].device
    return KVPoolLayout(regions=sorted(regions.items()), spans=spans, device_type=device.type,
                        device_id=device.index or 0)
