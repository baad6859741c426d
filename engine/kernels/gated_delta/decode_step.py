"""Gated DeltaNet for short runs of tokens on CUDA (decode steps, verify passes, their commits), in
two launches per layer instead of the ~35 small torch ops of the general path
(`engine.layers.gated_delta.GatedDeltaNet._run` with fla-core's kernels, which prefill keeps):

  conv_qkv     the causal depthwise conv (width 4) over [window, new inputs], SiLU, then q and k
               L2-normalised per head (q scaled by dk^-1/2); the request's conv window is updated
               in place in its slot (unless a verify pass defers the commit). One program per head
               of q, k or v channels, so each window entry is read and written by one program.
  recurrent    the gated delta rule per value head and block of dv, the state [dk, BV] in
               registers, read from and written back to the request's slot in place (no gathered
               copy of the state); beta = sigmoid(b) and g = -exp(A_log) * softplus(a + dt_bias)
               computed inside. A commit replays the first num_kept tokens of each row only.
and GatedRMSNorm after them is one more (engine.kernels.elementwise.gated_rms_norm).

Each rounds where its torch twin rounds (the conv output and its SiLU in the model dtype; q, k
float32; beta in the model dtype), so the two agree within float32 summation order; tests hold
them to `engine.kernels.gated_delta.reference` and the layer's general path. Grids depend on shapes only
(CUDA-graph safe); slots are read on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import pdl
CONV_WIDTH = 4            # Qwen3.5's linear_conv_kernel_dim; other widths take the general path


@triton.jit
def _conv_qkv_kernel(x_ptr, win_ptr, w_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, n, Hk, DK, DV, key_dim, q_scale,
                     stride_xb, stride_xt, stride_ws, stride_wc, stride_qb, stride_qt, stride_vb, stride_vt,
                     WRITE_WINDOW: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    b = tl.program_id(0)
    head = tl.program_id(1)                      # q heads [0, Hk), k heads [Hk, 2Hk), v heads after
    is_v = head >= 2 * Hk
    width = tl.where(is_v, DV, DK)
    c0 = tl.where(is_v, 2 * key_dim + (head - 2 * Hk) * DV, head * DK)
    offs = tl.arange(0, BLOCK)
    mask = offs < width
    ch = c0 + offs
    dt = x_ptr.dtype.element_ty
    w0 = tl.load(w_ptr + ch * 4 + 0, mask=mask, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + ch * 4 + 1, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + ch * 4 + 2, mask=mask, other=0.0).to(tl.float32)
    w3 = tl.load(w_ptr + ch * 4 + 3, mask=mask, other=0.0).to(tl.float32)
    pdl.wait_for_inputs(USE_PDL)  # the weights above are read-only
    slot = tl.load(slot_ptr + b).to(tl.int64)
    wrow = win_ptr + slot * stride_ws + ch * stride_wc
    r0 = tl.load(wrow + 0, mask=mask, other=0.0).to(tl.float32)
    r1 = tl.load(wrow + 1, mask=mask, other=0.0).to(tl.float32)
    r2 = tl.load(wrow + 2, mask=mask, other=0.0).to(tl.float32)
    for t in range(n):
        x = tl.load(x_ptr + b * stride_xb + t * stride_xt + ch, mask=mask, other=0.0).to(tl.float32)
        y = (w0 * r0 + w1 * r1 + w2 * r2 + w3 * x).to(dt).to(tl.float32)       # conv1d rounds its output
        y = (y / (1.0 + tl.exp(-y))).to(dt).to(tl.float32)                     # and SiLU its own
        if is_v:
            tl.store(v_ptr + b * stride_vb + t * stride_vt + (head - 2 * Hk) * DV + offs, y.to(dt), mask=mask)
        else:
            y = y * tl.rsqrt(tl.sum(y * y, 0) + 1e-6)
            if head < Hk:
                tl.store(q_ptr + b * stride_qb + t * stride_qt + head * DK + offs, y * q_scale, mask=mask)
            else:
                tl.store(k_ptr + b * stride_qb + t * stride_qt + (head - Hk) * DK + offs, y, mask=mask)
        r0, r1, r2 = r1, r2, x
    if WRITE_WINDOW:
        tl.store(wrow + 0, r0.to(dt), mask=mask)
        tl.store(wrow + 1, r1.to(dt), mask=mask)
        tl.store(wrow + 2, r2.to(dt), mask=mask)


def conv_qkv(mixed: torch.Tensor, window: torch.Tensor, conv_weight: torch.Tensor, slots: torch.Tensor,
             num_k_heads: int, head_k_dim: int, head_v_dim: int, write_window: bool):
    """mixed: [B, n, C] (in_proj_qkv's output; C = 2 Hk dk + Hv dv); window: [slots, C, 3] model dtype;
    conv_weight: [C, 4]; slots: [B] -> q, k [B, n, Hk, dk] float32 (normalised), v [B, n, Hv, dv]."""
    B, n, C = mixed.shape
    key_dim = num_k_heads * head_k_dim
    num_v_heads = (C - 2 * key_dim) // head_v_dim
    q = torch.empty(B, n, num_k_heads, head_k_dim, dtype=torch.float32, device=mixed.device)
    k = torch.empty_like(q)
    v = torch.empty(B, n, num_v_heads, head_v_dim, dtype=mixed.dtype, device=mixed.device)
    if B and n:
        block = triton.next_power_of_2(max(head_k_dim, head_v_dim))
        _conv_qkv_kernel[(B, 2 * num_k_heads + num_v_heads)](
            mixed, window, conv_weight, slots, q, k, v, n, num_k_heads, head_k_dim, head_v_dim, key_dim,
            head_k_dim ** -0.5, mixed.stride(0), mixed.stride(1), window.stride(0), window.stride(1),
            q.stride(0), q.stride(1), v.stride(0), v.stride(1), WRITE_WINDOW=write_window, BLOCK=block,
            num_warps=1 if block <= 128 else 2, **pdl.launch_options(mixed.device))
    return q, k, v


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, ssm_ptr, slot_ptr, keep_ptr, o_ptr,
                      n, group, DK, DV, stride_qb, stride_qt, stride_vb, stride_vt, stride_ab, stride_at,
                      stride_ss, stride_sh, stride_ob, stride_ot,
                      HAS_KEEP: tl.constexpr, WRITE_STATE: tl.constexpr, STORE_O: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, USE_PDL: tl.constexpr = False):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    kh = h // group
    offs_k = tl.arange(0, BK)
    offs_v = vb * BV + tl.arange(0, BV)
    k_ok, v_ok = offs_k < DK, offs_v < DV
    decay_rate = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    pdl.wait_for_inputs(USE_PDL)  # A_log and dt_bias are weights
    slot = tl.load(slot_ptr + b).to(tl.int64)
    s_ptrs = ssm_ptr + slot * stride_ss + h * stride_sh + offs_k[:, None] * DV + offs_v[None, :]
    smask = k_ok[:, None] & v_ok[None, :]
    S = tl.load(s_ptrs, mask=smask, other=0.0)                                  # [BK, BV] float32
    keep = tl.load(keep_ptr + b) if HAS_KEEP else n
    dt = v_ptr.dtype.element_ty
    for t in range(n):
        q = tl.load(q_ptr + b * stride_qb + t * stride_qt + kh * DK + offs_k, mask=k_ok, other=0.0)
        k = tl.load(k_ptr + b * stride_qb + t * stride_qt + kh * DK + offs_k, mask=k_ok, other=0.0)
        v = tl.load(v_ptr + b * stride_vb + t * stride_vt + h * DV + offs_v, mask=v_ok, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + b * stride_ab + t * stride_at + h).to(tl.float32) + dt_bias
        bb = tl.load(b_ptr + b * stride_ab + t * stride_at + h).to(tl.float32)
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
        g = -decay_rate * softplus
        beta = (1.0 / (1.0 + tl.exp(-bb))).to(dt).to(tl.float32)
        live = t < keep                                  # a commit's rejected tail leaves S unchanged
        g = tl.where(live, g, 0.0)
        beta = tl.where(live, beta, 0.0)
        S = S * tl.exp(g)
        u = beta * (v - tl.sum(S * k[:, None], 0))                             # [BV]
        S = S + k[:, None] * u[None, :]
        if STORE_O:
            o = tl.sum(S * q[:, None], 0)
            tl.store(o_ptr + b * stride_ob + t * stride_ot + h * DV + offs_v, o, mask=v_ok)
    if WRITE_STATE:
        tl.store(s_ptrs, S, mask=smask)


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              A_log: torch.Tensor, dt_bias: torch.Tensor, ssm: torch.Tensor, slots: torch.Tensor, *,
              num_kept: torch.Tensor | None = None, write_state: bool = True, store_output: bool = True):
    """q, k: [B, n, Hk, dk] float32; v: [B, n, Hv, dv]; a, b: [B, n, Hv] (in_proj_a / in_proj_b outputs);
    A_log, dt_bias: [Hv]; ssm: [slots, Hv, dk, dv] float32, updated in place at `slots` [B] when
    `write_state`; num_kept: [B] or None (all n tokens) -> o [B, n, Hv, dv] float32 (or None)."""
    B, n, Hk, dk = q.shape
    Hv, dv = v.shape[2], v.shape[3]
    o = torch.empty(B, n, Hv, dv, dtype=torch.float32, device=q.device) if store_output else None
    if B == 0 or n == 0:
        return o
    bk = triton.next_power_of_2(dk)
    bv = min(32, triton.next_power_of_2(dv))
    a2, b2 = a.reshape(B, n, Hv), b.reshape(B, n, Hv)
    if a2.stride() != b2.stride():
        a2, b2 = a2.contiguous(), b2.contiguous()
    out = o if o is not None else q
    _recurrent_kernel[(B, Hv, triton.cdiv(dv, bv))](
        q, k, v, a2, b2, A_log, dt_bias, ssm, slots, num_kept if num_kept is not None else slots, out,
        n, Hv // Hk, dk, dv, q.stride(0), q.stride(1), v.stride(0), v.stride(1), a2.stride(0), a2.stride(1),
        ssm.stride(0), ssm.stride(1), out.stride(0), out.stride(1),
        HAS_KEEP=num_kept is not None, WRITE_STATE=write_state, STORE_O=store_output, BK=bk, BV=bv,
        num_warps=4, **pdl.launch_options(q.device))
    return o
