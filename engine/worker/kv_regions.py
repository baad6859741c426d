"""Where the KV pool's blocks sit in memory, for a transfer engine (prefill/decode disaggregation).

The pool is one tensor for all layers (`model_runner.allocate_kv`: [layers, 2, blocks, block_size,
kv_heads, head_dim], plus a float32 scale tensor when int8), so a block of one layer's K or V is one
contiguous span: `base + block_id * stride`. A transfer engine registers the pool's storages once
(`regions`) and moves block lists as (address, bytes) spans.

The same holds for what a request keeps beside its blocks: a hybrid's linear-attention state slot
(`engine.worker.state_pool`: per linear layer, conv window [slots, channels, kernel - 1] and recurrent
matrix [slots, heads, dk, dv], slot s at `base + s * stride`) and, with MTP, its row of the hidden-state
pool (`engine.worker.mtp_hidden_pool`: [rows, k + 1, hidden]). They are registered with the KV pool.
"""

from __future__ import annotations

from collections.abc import Iterable
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
    state_spans: tuple[BlockSpan, ...] = ()   # hybrids: per linear layer, conv window then matrix, by slot
    hidden_spans: tuple[BlockSpan, ...] = ()  # MTP: the hidden-state pool, by row (one span)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every layer (what one block of a prompt costs to move)."""
        return sum(s.bytes_per_block for s in self.spans)

    def shape(self) -> list[int]:
        """Bytes per block of each span: two engines can exchange blocks only when these agree."""
        return [s.bytes_per_block for s in self.spans]

    def block_descs(self, block_ids: list[int]) -> list[tuple[int, int]]:
        """(address, bytes) of each span of each block, span-major (the same order on both sides)."""
        return span_descs(self.spans, block_ids)

    def slot_descs(self, slot: int) -> list[tuple[int, int]]:
        """(address, bytes) of one state slot in every linear layer (empty for a model without them)."""
        return span_descs(self.state_spans, [slot])

    def row_descs(self, row: int) -> list[tuple[int, int]]:
        """(address, bytes) of one row of the MTP hidden-state pool (empty without MTP)."""
        return span_descs(self.hidden_spans, [row])


def span_descs(spans: Iterable[BlockSpan], indices: list[int]) -> list[tuple[int, int]]:
    """(address, bytes) of entry i of each span for each i in `indices`, span-major: what a transfer engine moves."""
    return [(s.base + i * s.stride, s.bytes_per_block) for s in spans for i in indices]


def _spans(tensors: list[torch.Tensor], what: str) -> list[BlockSpan]:
    if any(not t[0].is_contiguous() for t in tensors):
        raise RuntimeError(f"a {what} is not contiguous in its pool: it cannot move as one span")
    return [BlockSpan(t.data_ptr(), t.stride(0) * t.element_size(), t[0].numel() * t.element_size())
            for t in tensors]


def kv_pool_layout(kv: list[LayerKV], states: list[torch.Tensor] = (),
                   hidden: torch.Tensor | None = None) -> KVPoolLayout:
    """The pool's layout; `states`: each linear layer's conv and matrix tensors (hybrids), `hidden`: the
    MTP hidden-state pool. Each is indexed by its first dimension (block, slot, row)."""
    tensors = [t for layer in kv for t in (layer.k, layer.v, layer.k_scale, layer.v_scale) if t is not None]
    rows = [hidden] if hidden is not None else []
    regions: dict[int, int] = {}
    for t in (*tensors, *states, *rows):
        storage = t.untyped_storage()
        regions[storage.data_ptr()] = storage.nbytes()
    device: torch.device = tensors[0].device
    return KVPoolLayout(regions=sorted(regions.items()), spans=_spans(tensors, "KV block"),
                        device_type=device.type, device_id=device.index or 0,
                        state_spans=tuple(_spans(list(states), "state slot")),
                        hidden_spans=tuple(_spans(rows, "hidden-state row")))
