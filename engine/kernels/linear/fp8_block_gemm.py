"""Prefill FP8 W8A8 GEMM with the checkpoint's 128x128 weight blocks and 1x128 activation blocks, in Triton.

    y[M, N] = sum over K-blocks kb of (A_kb @ W_kb^T) * sa[M, kb] * sw[N // 128, kb]

A is the activations quantized per token and 128 columns (engine/kernels/linear/act_quant.py), W the FP8
weight as stored. Each K step of 128 is one FP8 tensor-core dot into a fresh fp32 tile, scaled by the
two block scales and added to the accumulator (the scales change every 128 columns, so they cannot
be folded into the dot). Programs walk the output in groups of GROUP_M row tiles so that a group
reuses the same weight tiles from L2. Grid from shapes only.

Chosen by measurement against torch's block-scaled cuBLAS GEMM and dequantize + bf16 cuBLAS
(tools/dev/gemv_sweep.py, bench/results/2026-11-30-h200-kern).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_block_gemm_kernel(a_ptr, sa_ptr, w_ptr, sw_ptr, c_ptr, M, N, K, stride_am, stride_sam, stride_sak,
                           stride_wn, stride_swn, stride_cm,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           SCALE_BN: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]          # [BM, BK]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]          # [BK, BN] = W^T tile
    sa_ptrs = sa_ptr + offs_m * stride_sam
    sw_ptrs = sw_ptr + (offs_n // SCALE_BN) * stride_swn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        sa = tl.load(sa_ptrs + kb * stride_sak, mask=m_ok, other=0.0)                   # [BM]
        sw = tl.load(sw_ptrs + kb, mask=n_ok, other=0.0)                               # [BN]
        acc += tl.dot(a, w) * (sa[:, None] * sw[None, :])
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8


DEFAULT = Fp8GemmConfig()


def fp8_block_gemm(a: torch.Tensor, sa: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                   out_dtype: torch.dtype, rows: int | None = None, scale_block: tuple[int, int] = (128, 128),
                   config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """a: fp8 [>= M, K]; sa: fp32 [>= M, K/128] (any strides); weight: fp8 [N, K]; scale_inv: fp32
    [N/br, K/128] -> [M, N] (M = rows, default all of a's rows). K must be a multiple of 128."""
    cfg = config or DEFAULT
    M = rows if rows is not None else a.shape[0]
    K = a.shape[1]
    N = weight.shape[0]
    if K % 128 or scale_block[1] != 128:
        raise ValueError(f"the FP8 block GEMM needs K and the scale block's columns divisible by 128, got {K}, {scale_block}")
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _fp8_block_gemm_kernel[grid](a, sa, weight, scale_inv, out, M, N, K, a.stride(0), sa.stride(0), sa.stride(1),
                                 weight.stride(0), scale_inv.stride(0), out.stride(0),
                                 BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=128, SCALE_BN=scale_block[0],
                                 GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
