"""Gated full attention of Qwen3.5-class hybrids, over paged KV.

Differences from Qwen3's attention: `q_proj` emits, per head, the query (head_dim) followed by an
output gate (head_dim), and the attention output is multiplied by sigmoid(gate) before `o_proj`;
q/k norms are zero-centred; RoPE (rotate-half) turns only the first `partial_rotary_factor` of each
head's dims, the rest pass through. On CUDA the norms, the partial RoPE and the gate take two
Triton launches (engine.kernels.elementwise.gated_attention_prep); the torch code below is their twin.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.attention import PagedAttention
from engine.layers.hybrid_norm import ZeroCentredRMSNorm
from engine.layers.linear import QKVParallelLinear, RowParallelLinear
from engine.layers.rotary import RotaryEmbedding
from engine.distributed.tp_group import SINGLE_RANK, TPGroup


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TPGroup = SINGLE_RANK, quant=None):
        # quant: checkpoint projection names -> the quantized format of their fused layer (or None)
        super().__init__()
        quant = quant or (lambda parts: None)
        d = cfg.head_dim
        # q rows per head: the query, then its output gate (checkpoint shard "q" [2 heads d, H])
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads, tp,
                                          quant(["q_proj", "k_proj", "v_proj"]), q_rows_per_head=2)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, tp, quant(["o_proj"]))
        self.q_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps)
        self.rotary = rotary                                   # built for the rotary dims only
        self.rotary_dim = rotary.cos_sin.shape[-1]
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, d ** -0.5)

    def _fused_prep_fits(self) -> bool:
        from engine.kernels.elementwise import gated_attention_prep
        return gated_attention_prep.supported(self.head_dim, self.rotary_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # positions: [T]; x: [T, hidden] -> [T, hidden]
        d, h, kvh = self.head_dim, self.num_heads, self.num_kv_heads
        qg, k, v = self.qkv_proj(x).split([2 * h * d, kvh * d, kvh * d], dim=-1)
        q, gate = qg.view(-1, h, 2 * d).split([d, d], dim=-1)                 # [T, h, d] each
        if x.is_cuda and self._fused_prep_fits():
            from engine.kernels.elementwise import gated_attention_prep as prep
            q, k = prep.qk_norm_partial_rope(q, k.view(-1, kvh, d), self.q_norm.weight, self.k_norm.weight,
                                             self.q_norm.eps, self.rotary.cos_sin, positions)
            o = self.attn(q, k, v.reshape(-1, kvh, d))
            return self.o_proj(prep.sigmoid_gate_mul(o, gate))
        q, k = self.q_norm(q), self.k_norm(k.view(-1, kvh, d))
        r = self.rotary_dim
        q_rot, k_rot = self.rotary(positions, q[..., :r], k[..., :r])
        q = torch.cat([q_rot, q[..., r:]], dim=-1)
        k = torch.cat([k_rot, k[..., r:]], dim=-1)
        o = self.attn(q.contiguous(), k.contiguous(), v.reshape(-1, kvh, d))
        return self.o_proj(o.flatten(1) * torch.sigmoid(gate.flatten(1)))
