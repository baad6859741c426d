"""Paged attention: write the new tokens' K/V into their slots, then attend over each sequence's pages.

The reference path below is plain torch and serves the CPU; on CUDA the Triton kernels of
`engine.kernels` do the same work (the tests hold the two together).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.forward_context import ForwardContext, get_forward_context
from engine.worker.paged_kv import LayerKV

INT8_MAX = 127.0


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-(token, head) quantization. x: [T, kv_heads, head_dim] -> (int8 same shape, [T, kv_heads])."""
    scale = x.float().abs().amax(dim=-1).clamp(min=1e-8) / INT8_MAX
    q = torch.round(x.float() / scale.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def write_kv_reference(kv: LayerKV, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    # k, v: [T, kv_heads, head_dim]; slot_mapping: [T] (-1 = padding, written nowhere)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k, v = k[keep], v[keep]
    flat = lambda t: t.view(-1, *t.shape[2:])  # noqa: E731  [blocks * block_size, ...]
    if kv.quantized:
        (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
        flat(kv.k)[slots], flat(kv.k_scale)[slots] = kq, ks
        flat(kv.v)[slots], flat(kv.v_scale)[slots] = vq, vs
    else:
        flat(kv.k)[slots] = k.to(kv.k.dtype)
        flat(kv.v)[slots] = v.to(kv.v.dtype)


def _gather_pages(pages: torch.Tensor, scale: torch.Tensor | None, table: torch.Tensor, n: int,
                  dtype: torch.dtype) -> torch.Tensor:
    # -> [n, kv_heads, head_dim] in `dtype`: the first n positions of one sequence
    x = pages[table].flatten(0, 1)[:n]
    if scale is None:
        return x.to(dtype)
    return (x.float() * scale[table].flatten(0, 1)[:n].unsqueeze(-1)).to(dtype)


def paged_attention_reference(q: torch.Tensor, kv: LayerKV, ctx: ForwardContext, scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim]; causal within each sequence."""
    out = torch.empty_like(q)
    block_size = kv.k.shape[1]
    group = q.shape[1] // kv.k.shape[2]
    start = 0
    query_lens, seq_lens = ctx.host_lens()
    for i, (n_q, n_kv) in enumerate(zip(query_lens, seq_lens)):
        if n_q == 0:
            continue
        table = ctx.block_tables[i, :-(-n_kv // block_size)].long()
        k = _gather_pages(kv.k, kv.k_scale, table, n_kv, q.dtype).repeat_interleave(group, dim=1)
        v = _gather_pages(kv.v, kv.v_scale, table, n_kv, q.dtype).repeat_interleave(group, dim=1)
        # query j sits at position n_kv - n_q + j and sees keys 0 .. n_kv - n_q + j
        mask = torch.ones(n_q, n_kv, dtype=torch.bool, device=q.device).tril(diagonal=n_kv - n_q)
        o = F.scaled_dot_product_attention(
            q[start:start + n_q].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=scale)
        out[start:start + n_q] = o.transpose(0, 1)
        start += n_q
    return out


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.kv: LayerKV | None = None           # bound by the runner once the pool exists

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        # q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim], or None when a fused kernel
        # already wrote them into the pages -> [T, heads, head_dim]
        ctx = get_forward_context()
        if q.is_cuda:
            from engine.kernels.attention import paged as kernels
            if k is not None:
                kernels.write_kv(self.kv, k, v, ctx.slot_mapping)
            return kernels.paged_attention(q, self.kv, ctx, self.scale)
        if k is not None:
            write_kv_reference(self.kv, k, v, ctx.slot_mapping)
        return paged_attention_reference(q, self.kv, ctx, self.scale)
