"""The grouped GEMM over expert-sorted rows (the fused-MoE design of vLLM/SGLang, written here from its
description; docs/moe.md):  C[slot] = A[slot // a_div] @ W[expert(slot)]^T  for every slot of `sorted_ids`.

Grid: one program per (block of BLOCK_M sorted rows, block of BLOCK_N output features), in GROUP_M swizzled
order. A program whose row block starts at or past the used length (`num_post`, read on the device) returns
at once: the grid is sized for the worst case, so nothing here reads the host. Each row block belongs to
one expert (the sort padded every expert to a multiple of BLOCK_M), so the program streams that expert's
weight tile once for all its rows -- at decode, with BLOCK_M >= the tokens of the round, every chosen expert
is one row block and its weights are read once per round however many rows (batch rows, MTP verify
positions) chose it. Rows are gathered from A by slot // a_div (a_div = top_k for the first GEMM: every
choice of a token reads the token's hidden state; no permuted copy of the activations), and stored at row
`slot` of C: the scatter back to (token, choice) order is the store's address.

The weight tile is the dot's first operand ([BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M]), as the skinny
quantized GEMM does (engine.kernels.linear.quant_gemm), and is dequantized in registers:
- FMT_FLOAT: bf16/fp16/fp32 weights as they are (float32 operands multiply in IEEE float32, not TF32);
- FMT_FP8: e4m3 bytes put in the bits of an fp16 number (sign, then exponent and mantissa shifted by 7:
  2^-8 times the value, exact for every code, subnormals included, and on every architecture -- no fp8 type
  needed, so sm80 compiles it); the 128x128 block scale times 2^8 multiplies each K step's partial dot (a K
  step never crosses a scale block);
- FMT_NVFP4: E2M1 codes as fp16 bits (engine.kernels.linear.quant_gemm._e2m1_times_2p14) times their E4M3
  group scale (decoded the same way); even and odd columns are two dots against the even and odd activation
  columns; the per-tensor scale (kept per row) multiplies the accumulator once.
GATED (the gate/up GEMM): the program also streams the up rows N + n of its gate rows n and stores
silu(gate) * up -- the SwiGLU in the epilogue, so the [slots, 2I] intermediate is never written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.linear.quant_gemm import _e2m1_times_2p14

FMT_FLOAT, FMT_FP8, FMT_NVFP4 = 0, 1, 2
FORMATS = {None: FMT_FLOAT, "fp8": FMT_FP8, "nvfp4": FMT_NVFP4}


@triton.jit
def _e4m3_times_2m8(b):
    # b: e4m3 bytes (uint8) -> float32, 2^-8 times their value: fp16 bits s.eeee.mmm0000000 (exponent bias 15 vs 7)
    b = b.to(tl.int32)
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _partial_dot(a_rows, a_ok, w_rows, n_ok, s_rows, k0, K, scale_bc,
                 FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    # one K step of one weight tile against the gathered rows: -> float32 [BLOCK_N, BLOCK_M]
    dt = a_rows.dtype.element_ty
    if FMT == 2:
        offs_p = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        p_ok = offs_p < K // 2
        p = tl.load(w_rows + offs_p[None, :], mask=n_ok[:, None] & p_ok[None, :], other=0).to(tl.int32)
        offs_g = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        s = tl.load(s_rows + offs_g[None, :], mask=n_ok[:, None] & (offs_g[None, :] < K // 16), other=0)
        s = (_e4m3_times_2m8(s) * 4194304.0)[:, :, None]                        # group scale x 2^14, [BN, BK/16, 1]
        lo = tl.reshape(tl.reshape(_e2m1_times_2p14(p & 15), (BLOCK_N, BLOCK_K // 16, 8)) * s,
                        (BLOCK_N, BLOCK_K // 2)).to(dt)
        hi = tl.reshape(tl.reshape(_e2m1_times_2p14(p >> 4), (BLOCK_N, BLOCK_K // 16, 8)) * s,
                        (BLOCK_N, BLOCK_K // 2)).to(dt)
        a_even = a_rows + 2 * offs_p[:, None]                                     # [BK/2, BM]
        m = a_ok[None, :] & p_ok[:, None]
        if IEEE:
            acc = tl.dot(lo, tl.load(a_even, mask=m, other=0.0), input_precision="ieee")
            acc += tl.dot(hi, tl.load(a_even + 1, mask=m, other=0.0), input_precision="ieee")
        else:
            acc = tl.dot(lo, tl.load(a_even, mask=m, other=0.0))
            acc += tl.dot(hi, tl.load(a_even + 1, mask=m, other=0.0))
        return acc
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
    if FMT == 1:
        w = _e4m3_times_2m8(w)
    a = tl.load(a_rows + offs_k[:, None], mask=a_ok[None, :] & k_ok[:, None], other=0.0)   # [BK, BM]
    if IEEE:
        acc = tl.dot(w.to(dt), a, input_precision="ieee")
    else:
        acc = tl.dot(w.to(dt), a)
    if FMT == 1:
        acc = acc * (tl.load(s_rows + k0 // scale_bc, mask=n_ok, other=0.0) * 256.0)[:, None]
    return acc


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, s_ptr, s2_ptr, c_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
                     N, K, num_slots, a_div, num_pid_m, stride_am, stride_we, stride_wn, stride_se, stride_sn,
                     stride_s2e, stride_cm, scale_br, scale_bc,
                     FMT: tl.constexpr, GATED: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    slot = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    a_ok = slot < num_slots
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    a_rows = a_ptr + (slot // a_div).to(tl.int64)[None, :] * stride_am
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    up_offset = N * stride_wn                                   # GATED: the up rows follow the N gate rows
    if FMT == 1:                                                # a block-scale row per output row
        s_rows = s_ptr + expert * stride_se + (offs_n // scale_br).to(tl.int64) * stride_sn
        up_scale_offset = (N // scale_br) * stride_sn
    else:                                                       # NVFP4: a group-scale row per output row
        s_rows = s_ptr + expert * stride_se + offs_n[:, None].to(tl.int64) * stride_sn
        up_scale_offset = N * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc += _partial_dot(a_rows, a_ok, w_rows, n_ok, s_rows, k0, K, scale_bc, FMT, BLOCK_N, BLOCK_K, IEEE)
        if GATED:
            acc_up += _partial_dot(a_rows, a_ok, w_rows + up_offset, n_ok, s_rows + up_scale_offset,
                                   k0, K, scale_bc, FMT, BLOCK_N, BLOCK_K, IEEE)
    if FMT == 2:
        s2 = s2_ptr + expert * stride_s2e + offs_n
        acc *= tl.load(s2, mask=n_ok, other=0.0)[:, None]
        if GATED:
            acc_up *= tl.load(s2 + N, mask=n_ok, other=0.0)[:, None]
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    c = c_ptr + slot.to(tl.int64)[None, :] * stride_cm + offs_n[:, None]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=a_ok[None, :] & n_ok[:, None])


@dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def default_config(rows_per_block: int, fmt: str | None, n: int, k: int) -> GemmConfig:
    """First tiles, not measured yet (the GPU run tunes them). The same BLOCK_N and BLOCK_K at every row count:
    a row's sums then run in one order whether 1, 4 or 64 rows of a round chose the expert (MTP verify rows equal
    decode rows)."""
    bk = min(128 if fmt == "nvfp4" else 64, max(32 if fmt == "nvfp4" else 16, triton.next_power_of_2(k)))
    return GemmConfig(min(64, max(16, triton.next_power_of_2(n))), bk)


def moe_gemm(a: torch.Tensor, experts, proj: str, slots, out: torch.Tensor, a_div: int,
             config: GemmConfig | None = None) -> torch.Tensor:
    """a: [rows, K] (rows = T for the gate/up GEMM, T*k for down); experts: engine.layers.moe_experts.FusedExperts;
    proj: "w13" (gated: out [T*k, I_rank] = silu(gate) * up) or "w2" (out [T*k, H]); slots: align.SortedSlots."""
    fmt = experts.quant
    w = getattr(experts, f"{proj}_weight")
    gated = proj == "w13"
    N = w.shape[1] // 2 if gated else w.shape[1]
    K = a.shape[1]
    code = FORMATS[fmt]
    if fmt == "fp8":
        s = getattr(experts, f"{proj}_weight_scale_inv")
        br, bc = experts.scale_block13 if gated else experts.scale_block2
        s2, w = s, w.view(torch.uint8)
    elif fmt == "nvfp4":
        s, s2 = getattr(experts, f"{proj}_weight_scale").view(torch.uint8), getattr(experts, f"{proj}_weight_scale_2")
        br, bc = 1, 16
    else:
        s = s2 = w
        br, bc = 1, K
    cfg = config or default_config(slots.block_m, fmt, N, K)
    block_k = cfg.block_k if fmt != "fp8" else min(cfg.block_k, bc)
    if block_k < (32 if fmt == "nvfp4" else 16):
        raise ValueError(f"MoE GEMM: K step {block_k} (scale block {bc}) is below the tensor cores' 16 columns")
    num_pid_m = slots.expert_ids.numel()
    grid = (num_pid_m * triton.cdiv(N, cfg.block_n),)
    _moe_gemm_kernel[grid](a, w, s, s2, out, slots.sorted_ids, slots.expert_ids, slots.num_post,
                           N, K, slots.num_slots, a_div, num_pid_m, a.stride(0), w.stride(0), w.stride(1),
                           s.stride(0), s.stride(1), s2.stride(0), out.stride(0), br, bc,
                           FMT=code, GATED=gated, IEEE=a.dtype == torch.float32, BLOCK_M=slots.block_m,
                           BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
                           num_stages=cfg.num_stages)
    return out
