"""Linear-attention state on the device: one pool of slots per Gated DeltaNet layer, beside the KV pages.

A slot holds one request's state of one layer: the conv window (the last kernel-1 inputs of the
q, k, v channels, before the convolution) and the recurrent matrix [value heads, dk, dv]. Slots are
addressed by index (`ForwardContext.state_slots`), so that a CUDA graph replays with other slots
by changing an index tensor only; which request owns which slot is decided by the scheduler
(`engine.cache.state_slots`, no torch). The last slot is scratch for the padded rows of a graph bucket.

Precision: the conv window keeps the model dtype (its entries are copies of model-dtype
activations: exact). The recurrent matrix stays float32 whatever the KV dtype: it is an
accumulator rewritten at every token (decay, then a rank-one delta write), so bf16 or int8 storage
would add a rounding error per token that compounds over the whole context, unlike a KV entry that
is quantized once and read as written; the chunked and recurrent kernels also both run in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerState:
    conv: torch.Tensor      # [slots, conv channels, kernel - 1] model dtype
    ssm: torch.Tensor       # [slots, value heads, dk, dv] float32


class StateCache:
    """Every linear layer's slots; `num_slots` usable ones plus one scratch slot at index num_slots."""

    def __init__(self, layers: list, num_slots: int, dtype: torch.dtype, device: torch.device):
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self.layers: list[LayerState] = []
        for layer in layers:
            state = LayerState(
                conv=torch.zeros(num_slots + 1, layer.conv_channels, layer.kernel - 1, dtype=dtype, device=device),
                ssm=torch.zeros(num_slots + 1, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim,
                                dtype=torch.float32, device=device))
            layer.state = state
            self.layers.append(state)

    @property
    def bytes_per_slot(self) -> int:
        return sum(s.conv[0].numel() * s.conv.element_size() + s.ssm[0].numel() * 4 for s in self.layers)

    def reset(self, slot: int) -> None:
        """The state before any token: zero window (= the convolution's causal padding), zero matrix."""
        for s in self.layers:
            s.conv[slot].zero_()
            s.ssm[slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        for s in self.layers:
            s.conv[dst].copy_(s.conv[src])
            s.ssm[dst].copy_(s.ssm[src])
