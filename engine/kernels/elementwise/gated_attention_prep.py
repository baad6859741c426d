"""Gated attention's elementwise work on CUDA in two launches instead of ~15 small torch ops
(`engine.layers.gated_attention.GatedAttention.forward` keeps them as the twin elsewhere):

  qk_norm_partial_rope  per token: q and k heads zero-centred-RMSNormed over head_dim, then
                        rotate-half RoPE on the first `rotary_dim` dims only (the rest pass
                        through); q is read out of the q|gate rows of the fused projection.
  sigmoid_gate_mul      o * sigmoid(gate), gate read out of the same rows.

Rounding follows the twin: the norm's output and the rotated values are rounded to the model dtype
once each, sigmoid(gate) is rounded before the product. A head is handled as four pieces -- the two
rotated halves [0, r/2) and [r/2, r), then [r, d/2) and [d/2, d) -- so every piece is a power of two
when head_dim is and r = head_dim / 4 (Qwen3.5); other shapes take the torch path
(`supported`). Grids depend on shapes only (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import pdl

def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(head_dim: int, rotary_dim: int) -> bool:
    return _pow2(rotary_dim // 2) and _pow2(head_dim // 2 - rotary_dim) and 2 * rotary_dim <= head_dim


@triton.jit
def _piece(ptr, offs, rows, stride_h, mask):
    return tl.load(ptr + rows[:, None] * stride_h + offs[None, :], mask=mask[:, None], other=0.0).to(tl.float32)


@triton.jit
def _norm_rope_heads(src, dst, w_ptr, cos, sin, heads, stride_h, dst_stride_h, eps, D: tl.constexpr,
                     R2: tl.constexpr, REST: tl.constexpr, HALF: tl.constexpr, HEADS_PAD: tl.constexpr):
    rows = tl.arange(0, HEADS_PAD)
    ok = rows < heads
    o_a, o_b = tl.arange(0, R2), R2 + tl.arange(0, R2)                  # rotated halves
    o_c, o_d = 2 * R2 + tl.arange(0, REST), HALF + tl.arange(0, HALF)    # pass-through
    a, b = _piece(src, o_a, rows, stride_h, ok), _piece(src, o_b, rows, stride_h, ok)
    c, d = _piece(src, o_c, rows, stride_h, ok), _piece(src, o_d, rows, stride_h, ok)
    ss = tl.sum(a * a, 1) + tl.sum(b * b, 1) + tl.sum(c * c, 1) + tl.sum(d * d, 1)
    r = tl.rsqrt(ss / D + eps)[:, None]
    dt = dst.dtype.element_ty
    a = (a * r * (1.0 + tl.load(w_ptr + o_a).to(tl.float32))[None, :]).to(dt).to(tl.float32)
    b = (b * r * (1.0 + tl.load(w_ptr + o_b).to(tl.float32))[None, :]).to(dt).to(tl.float32)
    c = (c * r * (1.0 + tl.load(w_ptr + o_c).to(tl.float32))[None, :]).to(dt)
    d = (d * r * (1.0 + tl.load(w_ptr + o_d).to(tl.float32))[None, :]).to(dt)
    out = dst + rows[:, None] * dst_stride_h
    m = ok[:, None]
    tl.store(out + o_a[None, :], (a * cos[None, :] - b * sin[None, :]).to(dt), mask=m)
    tl.store(out + o_b[None, :], (b * cos[None, :] + a * sin[None, :]).to(dt), mask=m)
    tl.store(out + o_c[None, :], c, mask=m)
    tl.store(out + o_d[None, :], d, mask=m)


@triton.jit
def _prep_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cs_ptr, pos_ptr, qo_ptr, ko_ptr, H, KVH,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, eps,
                 D: tl.constexpr, R2: tl.constexpr, REST: tl.constexpr, HALF: tl.constexpr,
                 H_PAD: tl.constexpr, KVH_PAD: tl.constexpr, USE_PDL: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    pdl.wait_for_inputs(USE_PDL)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cs_ptr + pos * stride_cs + tl.arange(0, R2))
    sin = tl.load(cs_ptr + pos * stride_cs + R2 + tl.arange(0, R2))
    _norm_rope_heads(q_ptr + t * stride_qt, qo_ptr + t * H * D, qw_ptr, cos, sin, H, stride_qh, D, eps,
                     D, R2, REST, HALF, H_PAD)
    _norm_rope_heads(k_ptr + t * stride_kt, ko_ptr + t * KVH * D, kw_ptr, cos, sin, KVH, stride_kh, D, eps,
                     D, R2, REST, HALF, KVH_PAD)


def qk_norm_partial_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                         eps: float, cos_sin: torch.Tensor, positions: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, d], k: [T, KVH, d] (strided views of the fused projection are fine; head_dim
    contiguous); weights [d] (offsets from one); cos_sin: [max_pos, r] float32 (cos | sin of the
    rotary dims); positions [T] -> contiguous (q, k) in q's dtype."""
    T, H, D = q.shape
    KVH = k.shape[1]
    R = cos_sin.shape[-1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or not supported(D, R):
        raise ValueError(f"unsupported layout: head_dim {D}, rotary dims {R}, strides {q.stride()} {k.stride()}")
    q_out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, KVH, D, dtype=q.dtype, device=q.device)
    if T:
        _prep_kernel[(T,)](q, k, q_weight, k_weight, cos_sin, positions.contiguous(), q_out, k_out, H, KVH,
                           q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0), eps,
                           D=D, R2=R // 2, REST=D // 2 - R, HALF=D // 2, H_PAD=triton.next_power_of_2(H),
                           KVH_PAD=triton.next_power_of_2(KVH), num_warps=4, **pdl.launch_options(q.device))
    return q_out, k_out


@triton.jit
def _gate_kernel(o_ptr, g_ptr, out_ptr, H, stride_ot, stride_oh, stride_gt, stride_gh, D: tl.constexpr,
                 BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    m = offs < D
    dt = out_ptr.dtype.element_ty
    pdl.wait_for_inputs(USE_PDL)
    g = tl.load(g_ptr + t * stride_gt + h * stride_gh + offs, mask=m, other=0.0).to(tl.float32)
    s = (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    o = tl.load(o_ptr + t * stride_ot + h * stride_oh + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + (t * H + h) * D + offs, (o * s).to(dt), mask=m)


def sigmoid_gate_mul(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o, gate: [T, H, d] (strided views with a contiguous head_dim are fine) -> o * sigmoid(gate) as [T, H * d]."""
    T, H, D = o.shape
    if o.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError("o and gate need a contiguous head_dim")
    out = torch.empty(T, H * D, dtype=o.dtype, device=o.device)
    if T:
        _gate_kernel[(T, H)](o, gate, out, H, o.stride(0), o.stride(1), gate.stride(0), gate.stride(1), D=D,
                             BLOCK=triton.next_power_of_2(D), num_warps=2, **pdl.launch_options(o.device))
    return out
