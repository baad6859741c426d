"""Integer weight-only matmuls (GPTQ, AWQ, compressed-tensors pack-quantized): y[M, N] = x[M, K] @ W[N, K]^T with
W in the layer layout of engine.quant.int_formats (codes packed along K in int32 words, float32 group scales
and zero points, an optional act-order g_idx).

Codes become floats with bit operations, as Marlin-class kernels do: a field of `bits` bits shifted and masked
out of its word is ORed into the mantissa of 0x4B000000 (2^23 as float32), whose value is then 2^23 + u
exactly, and 2^23 is subtracted -- no integer-to-float conversion instruction. u is exact in bf16/fp16 too
(u < 256), so the tensor-core GEMM takes it as the dot's operand.

Group scales and zero points are applied in the accumulator, once per group and output rather than per
weight: a K tile lies inside one group (BLOCK_K divides group_size), so for every row m and output n

    acc[m, n] += s[n, g] * (sum_k u[n, k] x[m, k]  -  z[n, g] * sum_k x[m, k])

(the second sum is the tile's row sum of x). With an act-order g_idx a tile's columns belong to several
groups: their scales and zero points are gathered per column and applied to the weight before the dot.

  int_gemv   decode, M <= GEMV_MAX_ROWS: no tensor cores; each program streams BLOCK_N rows of words once and
             meets each activation row in turn
  int_gemm   more rows (decode batches, prefill): tl.dot on [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tiles of x and
             the codes, BLOCK_M 16 for up to 16 rows
Grids depend on shapes only (CUDA-graph safe). The reference is engine.quant.int_formats.dequantize_int.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_MAX_ROWS = 4          # decode rows on the FMA GEMV (batch 1 with k = 3 drafts verifies 4); more: tensor cores
MAGIC = tl.constexpr(0x4B000000)     # float32 2^23: OR a small integer u into its mantissa to get 2^23 + u


@triton.jit
def _codes(w_ptrs, mask, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K] float32 codes u of the words at w_ptrs ([BLOCK_N, BLOCK_K * BITS / 32])."""
    PACK: tl.constexpr = 32 // BITS
    words = tl.load(w_ptrs, mask=mask, other=0)
    shifts = tl.arange(0, PACK) * BITS
    fields = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)           # [BN, BK/PACK, PACK]
    u = (fields | MAGIC).to(tl.float32, bitcast=True) - 8388608.0
    return tl.reshape(u, (BLOCK_N, BLOCK_K))


@triton.jit
def _int_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, g_ptr, o_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
                     group_size, BITS: tl.constexpr, ACT_ORDER: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    PACK: tl.constexpr = 32 // BITS
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    rows = offs_n[:, None].to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        offs_w = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
        u = _codes(w_ptr + rows * stride_wn + offs_w[None, :], n_ok[:, None] & (offs_w[None, :] < K // PACK),
                   BITS, BLOCK_N, BLOCK_K)                                                  # [BN, BK]
        if ACT_ORDER:
            g = tl.load(g_ptr + offs_k, mask=k_ok, other=0)
            sz = rows * stride_sn + g[None, :]
            s = tl.load(s_ptr + sz, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            z = tl.load(z_ptr + sz, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            u = (u - z) * s
        else:
            g = k0 // group_size
            s = tl.load(s_ptr + offs_n.to(tl.int64) * stride_sn + g, mask=n_ok, other=0.0)    # [BN]
            z = tl.load(z_ptr + offs_n.to(tl.int64) * stride_sn + g, mask=n_ok, other=0.0)
        for m in tl.static_range(BLOCK_M):                  # one activation row at a time: [BN, BK] products
            x = tl.load(x_ptr + m * stride_xm + offs_k, mask=k_ok & (m < M), other=0.0).to(tl.float32)
            part = tl.sum(u * x[None, :], axis=1)                                           # [BN]
            if not ACT_ORDER:
                part = s * (part - z * tl.sum(x, axis=0))
            acc = tl.where(offs_m[:, None] == m, acc + part[None, :], acc)
    o = o_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(o, acc.to(o_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & n_ok[None, :])


@triton.jit
def _int_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, g_ptr, o_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
                     group_size, BITS: tl.constexpr, ACT_ORDER: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    PACK: tl.constexpr = 32 // BITS
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    rows = offs_n[:, None].to(tl.int64)
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        offs_w = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
        u = _codes(w_ptr + rows * stride_wn + offs_w[None, :], n_ok[:, None] & (offs_w[None, :] < K // PACK),
                   BITS, BLOCK_N, BLOCK_K)                                                  # [BN, BK]
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)                          # [BM, BK]
        if ACT_ORDER:
            g = tl.load(g_ptr + offs_k, mask=k_ok, other=0)
            sz = rows * stride_sn + g[None, :]
            s = tl.load(s_ptr + sz, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            z = tl.load(z_ptr + sz, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(((u - z) * s).to(dt)))
        else:
            g = k0 // group_size
            s = tl.load(s_ptr + offs_n.to(tl.int64) * stride_sn + g, mask=n_ok, other=0.0)    # [BN]
            z = tl.load(z_ptr + offs_n.to(tl.int64) * stride_sn + g, mask=n_ok, other=0.0)
            dot = tl.dot(x, tl.trans(u.to(dt)))                                             # [BM, BN] fp32
            xsum = tl.sum(x.to(tl.float32), axis=1)                                         # [BM]
            acc += s[None, :] * (dot - xsum[:, None] * z[None, :])
    o = o_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o, acc.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _block_k(K: int, group_size: int, act_order: bool, largest: int) -> int:
    """The K tile: inside one group (it divides group_size) unless the groups are gathered per column."""
    bk = largest
    if not act_order:
        span = group_size or K
        while bk > 16 and span % bk:
            bk //= 2
        if span % bk:
            raise ValueError(f"int matmul: group size {span} is not a multiple of 16")
    return bk


def int_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               group_size: int, g_idx: torch.Tensor | None = None, out_features: int | None = None,
               block: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x: [M, K] bf16/fp16; qweight: int32 [N, K*bits/32]; scales, zeros: float32 [N, groups]; g_idx: [K] or None
    -> [M, N] in x's dtype. `block`: (BLOCK_M, BLOCK_N, BLOCK_K) to override the launch shape (tests)."""
    M, K = x.shape
    N = out_features or qweight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    act = g_idx is not None
    gemv = M <= GEMV_MAX_ROWS
    bm, bn, bk = block or ((triton.next_power_of_2(M), 64, 64) if gemv else (16 if M <= 16 else 64, 64, 64))
    bk = _block_k(K, group_size, act, bk)
    args = (x, qweight, scales, zeros, g_idx if act else scales, out, M, N, K, x.stride(0), qweight.stride(0),
            scales.stride(0), out.stride(0), group_size or K)
    if gemv:
        _int_gemv_kernel[(triton.cdiv(N, bn),)](*args, BITS=bits, ACT_ORDER=act, BLOCK_M=bm, BLOCK_N=bn,
                                                BLOCK_K=bk, num_warps=4)
    else:
        _int_gemm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](*args, BITS=bits, ACT_ORDER=act, BLOCK_M=bm,
                                                                    BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    return out


def int_linear(layer, x: torch.Tensor) -> torch.Tensor:
    # x: [..., in] bf16/fp16 -> [..., out]
    shape = x.shape
    y = int_matmul(x.reshape(-1, shape[-1]), layer.qweight, layer.scales, layer.zeros, layer.bits, layer.group_size,
                   layer.g_idx, layer.out_features)
    return y.view(*shape[:-1], layer.out_features)
