"""Fused elementwise kernels of the Qwen3 layer: one pass over the activations instead of several.

Each does in one launch what its torch twin does in several (and rounds where the twin rounds, so
the two agree to the last bf16 bit or two):
  rms_norm      RMSNorm with the residual add (`engine.layers.norm.RMSNorm.forward`; and the hybrids'
                `ZeroCentredRMSNorm.forward`, weight as an offset from one)
  qk_norm_rope  q_norm/k_norm per head, then rotate-half RoPE (`Qwen3Attention.attend` lines
                q_norm, k_norm, rotary), optionally also writing K/V into the pages (write_kv)
  silu_and_mul  SwiGLU (`engine.layers.activation.SiluAndMul`)
All are CUDA-graph capturable: grids depend on shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import pdl
from engine.kernels.attention.paged import _load_halves, _store_kv_token, page_args
from engine.worker.paged_kv import LayerKV


# -- RMSNorm (+ residual) -------------------------------------------------------------------------

@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, o_ptr, ro_ptr, stride_x, stride_r, stride_o, stride_ro, n, eps,
                     BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ZERO_CENTRED: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    dt = o_ptr.dtype.element_ty
    # the weight is a model constant, so it may load before the PDL wait: its latency then hides under the
    # kernel before's tail and this row's reduction (loaded after the sum, it was a round trip of its own)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl.wait_for_inputs(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # the twin adds in the residual's dtype (the activation dtype; float32 under float16): round the sum
        # to it before it is stored and normed
        x = (x + tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)).to(ro_ptr.dtype.element_ty)
        tl.store(ro_ptr + row * stride_ro + offs, x, mask=mask)
        x = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / n + eps)
    if ZERO_CENTRED:
        y = x * r * (1.0 + w)                            # the hybrids' twin: one rounding, at the end
    else:
        y = (x * r).to(dt).to(tl.float32) * w            # weight * x_normed.to(dtype), as the twin
    tl.store(o_ptr + row * stride_o + offs, y.to(dt), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None, zero_centred: bool = False):
    """x, residual: [..., hidden]; weight: [hidden].

    Without residual: returns norm(x). With it: returns (norm(x + residual), x + residual), the
    contract of RMSNorm.forward: the sum in residual's dtype (float32 under float16 activations), the
    normed output in the weight's (x may be float32 there). out / residual_out: optional destinations.
    zero_centred: the weight is an offset from one (ZeroCentredRMSNorm of the hybrids).
    """
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    rows = x2.shape[0]
    dtype = x.dtype if residual is None else weight.dtype
    out = torch.empty(x.shape, dtype=dtype, device=x.device) if out is None else out
    o2 = out.view(-1, n)
    if residual is not None:
        r2 = residual.reshape(-1, n)
        residual_out = torch.empty(x.shape, dtype=residual.dtype, device=x.device) if residual_out is None else residual_out
        ro2 = residual_out.view(-1, n)
    else:
        r2 = ro2 = x2                                   # placeholders, never touched
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](x2, r2, weight, o2, ro2, x2.stride(0), r2.stride(0), o2.stride(0), ro2.stride(0),
                                  n, eps, BLOCK=block, HAS_RESIDUAL=residual is not None, ZERO_CENTRED=zero_centred,
                                  num_warps=min(16, max(1, block // 512)), **pdl.launch_options(x.device))
    return out if residual is None else (out, residual_out)


# -- q/k RMSNorm + RoPE (+ KV write) ---------------------------------------------------------------

QK_NORM_Q_BLOCK = 8          # query heads per program

@triton.jit
def _norm_rope(x1, x2, w_ptr, cos, sin, eps, half, dt, HALF: tl.constexpr):
    # per-head RMSNorm then rotate-half RoPE of rows given as halves [HEADS, HALF] (float32)
    r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
    w1 = tl.load(w_ptr + half).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + half).to(tl.float32)
    y1 = ((x1 * r[:, None]).to(dt).to(tl.float32) * w1[None, :]).to(dt).to(tl.float32)
    y2 = ((x2 * r[:, None]).to(dt).to(tl.float32) * w2[None, :]).to(dt).to(tl.float32)
    return y1 * cos[None, :] - y2 * sin[None, :], y2 * cos[None, :] + y1 * sin[None, :]


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cs_ptr, pos_ptr, qo_ptr, ko_ptr,
                         v_ptr, slot_ptr, kp_ptr, vp_ptr, ks_ptr, vs_ptr,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                         stride_cs, stride_vt, stride_vh,
                         stride_pb, stride_pt, stride_ph, stride_sb, stride_st, stride_sh, eps,
                         HEADS: tl.constexpr, KV_HEADS: tl.constexpr, Q_BLOCK: tl.constexpr,
                         KV_HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
                         STORE_K: tl.constexpr, WRITE_KV: tl.constexpr, PAGE: tl.constexpr, QUANT: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    pdl.wait_for_inputs(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    half = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cs_ptr + pos * stride_cs + half)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + half)
    dt = qo_ptr.dtype.element_ty

    part = tl.program_id(1)
    if part > 0:
        # program 1.. of a token: Q_BLOCK query heads each
        hq = (part - 1) * Q_BLOCK + tl.arange(0, Q_BLOCK)
        mq = hq < HEADS
        x1, x2 = _load_halves(q_ptr + t * stride_qt, hq, half, mq, stride_qh, HALF)
        q1, q2 = _norm_rope(x1, x2, qw_ptr, cos, sin, eps, half, dt, HALF)
        # names differ from the K branch's: Triton types a name set in both branches of an `if` once, and
        # [Q_BLOCK, HALF] is not [KV_HEADS_PAD, HALF] unless the padded KV heads happen to be Q_BLOCK
        pq = qo_ptr + t * stride_qot + hq[:, None] * stride_qoh + half[None, :]
        tl.store(pq, q1.to(dt), mask=mq[:, None])
        tl.store(pq + HALF, q2.to(dt), mask=mq[:, None])
    else:
        # program 0 of a token: its K heads (and the K/V write)
        hk = tl.arange(0, KV_HEADS_PAD)
        mk = hk < KV_HEADS
        y1, y2 = _load_halves(k_ptr + t * stride_kt, hk, half, mk, stride_kh, HALF)
        if WRITE_KV:
            # V and the slot load beside K, before any store: the compiler must assume a store to k_out or
            # the pages may alias them, so issued after those stores they were a round trip of their own.
            # Nor does V's mask wait for the slot: a slot -1 token has a V row too, which _store_kv_token drops
            slot = tl.load(slot_ptr + t)
            v1, v2 = _load_halves(v_ptr + t * stride_vt, hk, half, mk, stride_vh, HALF)
        k1, k2 = _norm_rope(y1, y2, kw_ptr, cos, sin, eps, half, dt, HALF)
        k1 = k1.to(dt)
        k2 = k2.to(dt)
        if STORE_K:
            pk = ko_ptr + t * stride_kot + hk[:, None] * stride_koh + half[None, :]
            tl.store(pk, k1, mask=mk[:, None])
            tl.store(pk + HALF, k2, mask=mk[:, None])
        if WRITE_KV:
            _store_kv_token(k1.to(tl.float32), k2.to(tl.float32), kp_ptr, ks_ptr, slot, hk, half, mk,
                            stride_pb, stride_pt, stride_ph, stride_sb, stride_st, stride_sh, HALF, PAGE, QUANT)
            _store_kv_token(v1, v2, vp_ptr, vs_ptr, slot, hk, half, mk,
                            stride_pb, stride_pt, stride_ph, stride_sb, stride_st, stride_sh, HALF, PAGE, QUANT)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 cos_sin: torch.Tensor, positions: torch.Tensor, *, q_out: torch.Tensor | None = None,
                 k_out: torch.Tensor | None = None, kv: LayerKV | None = None, v: torch.Tensor | None = None,
                 slot_mapping: torch.Tensor | None = None, return_k: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q: [T, heads, d], k: [T, kv_heads, d] (views into the qkv output are fine); q_weight, k_weight:
    [d]; cos_sin: [max_pos, d] float32 (cos | sin); positions: [T] -> (q, k) normed and rotated,
    contiguous, in q's dtype.

    With kv, v [T, kv_heads, d] and slot_mapping [T] it also does write_kv(kv, k_rotated, v,
    slot_mapping) in the same pass (attention must then skip its own write); return_k=False then
    skips storing the rotated k (returned as None) when only the pages need it.
    """
    T, H, d = q.shape
    kvh = k.shape[1]
    if d % 2 or d & (d - 1) or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"head_dim must be a power of two with contiguous rows, got {d}")
    q_out = torch.empty((T, H, d), dtype=q.dtype, device=q.device) if q_out is None else q_out
    if not return_k and kv is None:
        raise ValueError("return_k=False only makes sense with the K/V write")
    if return_k and k_out is None:
        k_out = torch.empty((T, kvh, d), dtype=q.dtype, device=q.device)
    positions = positions.contiguous()
    write = kv is not None
    if write:
        if v is None or slot_mapping is None:
            raise ValueError("writing K/V needs v and slot_mapping")
        kp, vp, ks, vs, *pstr = page_args(kv)
        slot_mapping = slot_mapping.contiguous()
        page, quant, vstr = kv.k.shape[1], kv.quantized, (v.stride(0), v.stride(1))
    else:
        v, slot_mapping, kp, vp, ks, vs = q, positions, q, q, q, q      # placeholders, never touched
        pstr, page, quant, vstr = [0] * 6, 1, False, (0, 0)
    ko = k_out if return_k else q_out                                # placeholder when not stored
    if T:
        # per token: one program for K (and the K/V write), and one per Q_BLOCK query heads beside it; at decode
        # a token's heads are then normed and rotated side by side, not one after another in a single program
        q_block = min(QK_NORM_Q_BLOCK, triton.next_power_of_2(H))
        _qk_norm_rope_kernel[(T, 1 + triton.cdiv(H, q_block))](
            q, k, q_weight, k_weight, cos_sin, positions, q_out, ko, v, slot_mapping, kp, vp, ks, vs,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
            ko.stride(0), ko.stride(1), cos_sin.stride(0), *vstr, *pstr, eps,
            HEADS=H, KV_HEADS=kvh, Q_BLOCK=q_block, KV_HEADS_PAD=triton.next_power_of_2(kvh),
            HALF=d // 2, STORE_K=return_k, WRITE_KV=write, PAGE=page, QUANT=quant, num_warps=4,
            **pdl.launch_options(q.device))
    return q_out, (k_out if return_k else None)


# -- SiLU * mul ----------------------------------------------------------------------------------------

@triton.jit
def _silu_mul_kernel(x_ptr, o_ptr, stride_x, stride_o, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dt = o_ptr.dtype.element_ty
    pdl.wait_for_inputs(USE_PDL)
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)    # F.silu rounds to the dtype, then the product
    tl.store(o_ptr + row * stride_o + offs, (s * u).to(dt), mask=mask)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., 2 * ffn] (gate then up) -> silu(gate) * up [..., ffn]."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device) if out is None else out
    o2 = out.view(-1, n)
    if x2.shape[0]:
        block = min(2048, triton.next_power_of_2(n))
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, o2, x2.stride(0), o2.stride(0), n,
                                                                BLOCK=block, num_warps=4, **pdl.launch_options(x.device))
    return out
