"""Matmuls of quantized linear layers on CUDA: y[M, N] = x[M, K] @ W[N, K]^T.

  mma gemv  decode at 1..8 rows (engine/kernels/linear/quant_gemv_mma.py, CUDA C): the weight streamed once in
            its checkpoint layout, decoded into the A operand of mma.sync; `quant_linear` takes it for
            the rows of quant_gemv_mma.MMA_GEMV_ROWS where it takes the shape, else the two below.
  gemv      decode at 1..8 rows (engine/kernels/linear/gemv.py): no tensor cores, the weight streamed once;
            `quant_linear` takes it up to gemv.GEMV_ROWS rows, then `skinny`.
  skinny    decode (M <= 64 rows): the weight tile is the dot's first operand, so it goes from
            registers to the tensor cores as dequantized (no shared-memory round trip), and the few
            activation rows are the second (16, 32 or 64 columns). FP8 blocks: e4m3 -> bf16 is exact
            and the block scale multiplies each K-block's partial dot. NVFP4: each E2M1 code is put
            in the bits of an fp16 number, 2^-14 times its value (exponent 0 is fp16's subnormal, so
            0 and 0.5 come out right with no table), times its E4M3 group scale (and 2^14) -- exact
            in bf16; even and odd columns are two dots against the even and odd activation columns,
            so the packed byte never has to be interleaved; the per-row tensor scale multiplies the
            accumulator once. Narrow layers split K over programs (fp32 partials, summed after).
  prefill   FP8: activations quantized per token and 128 columns (dynamic scales; one Triton pass,
            engine/kernels/linear/act_quant.py) and torch's block-scaled FP8 GEMM (1x128 by 128x128 scales,
            cuBLAS) where this torch has it;
            otherwise, and for NVFP4, the layer's weight is dequantized to bf16 into a scratch tensor
            by `dequantize` and multiplied by cuBLAS (tools/dev/quant_kernel_suite.py measured the
            dequantized-tile Triton GEMM at a third of cuBLAS's bf16 rate on the H200).
Grids depend on shapes only (CUDA-graph safe); nothing here talks to other ranks. The reference
every kernel is held to is `engine.quant.formats`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.linear import gemv, quant_gemv_mma
from engine.kernels.linear.gemv_triton import E2M1_ASM
from engine.kernels.linear.splitk import num_sms

NVFP4_CODE, FP8_CODE = 1, 0


@triton.jit
def _e2m1_times_2p14(c):
    # c: int32 codes 0..15 -> float32 value * 2^-14 via fp16 bits (sign 15, exponent 10..14, mantissa 9)
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, s_ptr, rs_ptr, o_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                   stride_om, stride_osplit, k_per_split, scale_br, scale_bc,
                   FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   ASM: tl.constexpr = False):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    for k0 in range(k_start, k_end, BLOCK_K):
        if FMT == 1:
            offs_p = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            p_ok = offs_p < k_end // 2
            p = tl.load(w_rows + offs_p[None, :], mask=n_ok[:, None] & p_ok[None, :], other=0)
            if ASM:     # engine.kernels.linear.gemv's PTX decode: four bytes -> eight values per call
                lo_v, hi_v = tl.inline_asm_elementwise(E2M1_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [p],
                                                       dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
            else:
                lo_v = _e2m1_times_2p14(p.to(tl.int32) & 15)
                hi_v = _e2m1_times_2p14(p.to(tl.int32) >> 4)
            offs_g = k0 // 16 + tl.arange(0, BLOCK_K // 16)
            s = tl.load(s_ptr + offs_n[:, None].to(tl.int64) * stride_sn + offs_g[None, :],
                        mask=n_ok[:, None] & (offs_g[None, :] < k_end // 16), other=0.0).to(tl.float32)
            s = (s * 16384.0)[:, :, None]                                           # [BN, BK/16, 1]
            lo = tl.reshape(tl.reshape(lo_v, (BLOCK_N, BLOCK_K // 16, 8)) * s, (BLOCK_N, BLOCK_K // 2)).to(dt)
            hi = tl.reshape(tl.reshape(hi_v, (BLOCK_N, BLOCK_K // 16, 8)) * s, (BLOCK_N, BLOCK_K // 2)).to(dt)
            x_even = x_ptr + offs_m[None, :] * stride_xm + 2 * offs_p[:, None]          # [BK/2, BM]
            xm = m_ok[None, :] & p_ok[:, None]
            acc += tl.dot(lo, tl.load(x_even, mask=xm, other=0.0))
            acc += tl.dot(hi, tl.load(x_even + 1, mask=xm, other=0.0))
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_end
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(dt)
            xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None], mask=m_ok[None, :] & k_ok[:, None],
                         other=0.0)
            s = tl.load(s_ptr + (offs_n // scale_br) * stride_sn + k0 // scale_bc, mask=n_ok, other=0.0)
            acc += tl.dot(w, xt) * s[:, None]
    if FMT == 1:
        acc *= tl.load(rs_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
    o = o_ptr + pid_k.to(tl.int64) * stride_osplit + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(o, acc.to(o_ptr.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])


@dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 0          # 0 = choose so that the grid fills the GPU
    programs_per_sm: int = 4  # what split_k=0 aims at
    asm: bool = False         # NVFP4: decode by inline PTX (CUDA only)


SKINNY_MAX_ROWS = 64


def default_config(fmt: str, M: int) -> GemmConfig:
    """Launch shapes (tools/dev/quant_kernel_suite.py sweeps them on the GPU)."""
    if fmt == "nvfp4":     # the PTX nibble decode: 0.17-0.19 of copy bandwidth at M = 8 against 0.15-0.17
        return GemmConfig(64, 256, 4, 4, asm=True)
    return GemmConfig(64, 128, 4, 4)


def skinny(x: torch.Tensor, fmt: str, weight: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor | None,
           out_features: int, scale_block: tuple[int, int] = (128, 128), config: GemmConfig | None = None) -> torch.Tensor:
    """x: [M <= 64, K] bf16/fp16; weight: fp8 [N, K] or packed uint8 [N, K/2]; scale: fp32 [N/br, K/bc]
    or fp8 [N, K/16]; row_scale: fp32 [N] (NVFP4) -> [M, N] in x's dtype."""
    M, K = x.shape
    if M > SKINNY_MAX_ROWS:
        raise ValueError(f"skinny matmul takes at most {SKINNY_MAX_ROWS} rows, got {M}")
    N = out_features
    cfg = config or default_config(fmt, M)
    bm = 16 if M <= 16 else (32 if M <= 32 else 64)
    bk = cfg.block_k if fmt == "nvfp4" else min(cfg.block_k, scale_block[1])
    grid_n = triton.cdiv(N, cfg.block_n)
    k_blocks = triton.cdiv(K, bk)
    split = cfg.split_k or max(1, min(k_blocks, 16, (cfg.programs_per_sm * num_sms(x.device)) // grid_n))
    k_per_split = triton.cdiv(k_blocks, split) * bk
    split = triton.cdiv(K, k_per_split)
    if split == 1:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
        stride_split = 0
    else:
        out = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
        stride_split = out.stride(0)
    _skinny_kernel[(grid_n, split)](x, weight, scale, row_scale if row_scale is not None else scale, out, M, N, K,
                                    x.stride(0), weight.stride(0), scale.stride(0), N, stride_split, k_per_split,
                                    scale_block[0], scale_block[1], FMT=NVFP4_CODE if fmt == "nvfp4" else FP8_CODE,
                                    BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=bk, ASM=cfg.asm and x.is_cuda,
                                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out if split == 1 else out.sum(0).to(x.dtype)


# kept for the tools' comparisons
wxa16 = skinny


# -- dequantize a whole weight (prefill) ------------------------------------------------------------

@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, rs_ptr, o_ptr, N, K, stride_wn, stride_sn, stride_on, scale_br, scale_bc,
                       FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr = False):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = offs_n[:, None].to(tl.int64)
    dt = o_ptr.dtype.element_ty
    if FMT == 1:
        offs_p = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        ok = n_ok[:, None] & (offs_p[None, :] < K // 2)
        p = tl.load(w_ptr + rows * stride_wn + offs_p[None, :], mask=ok, other=0)
        if ASM:
            lo, hi = tl.inline_asm_elementwise(E2M1_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [p],
                                               dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
        else:
            lo = _e2m1_times_2p14(p.to(tl.int32) & 15)
            hi = _e2m1_times_2p14(p.to(tl.int32) >> 4)
        s = tl.load(s_ptr + rows * stride_sn + offs_p[None, :] // 8, mask=ok, other=0.0).to(tl.float32)
        s = s * 16384.0 * tl.load(rs_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
        # even and odd columns interleaved in registers, so each row is stored contiguously
        vals = tl.reshape(tl.join(lo * s, hi * s), (BLOCK_N, BLOCK_K)).to(dt)
        offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        tl.store(o_ptr + rows * stride_on + offs_k[None, :], vals, mask=n_ok[:, None] & (offs_k[None, :] < K))
    else:
        offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        ok = n_ok[:, None] & (offs_k[None, :] < K)
        w = tl.load(w_ptr + rows * stride_wn + offs_k[None, :], mask=ok, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + (offs_n[:, None] // scale_br) * stride_sn + offs_k[None, :] // scale_bc, mask=ok, other=0.0)
        tl.store(o_ptr + rows * stride_on + offs_k[None, :], (w * s).to(dt), mask=ok)


def dequantize(fmt: str, weight: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor | None, out_features: int,
               in_features: int, dtype: torch.dtype, scale_block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """The layer's weight in `dtype` [N, K] (each value rounded once from the exact product)."""
    N, K = out_features, in_features
    out = torch.empty(N, K, dtype=dtype, device=weight.device)
    grid = (triton.cdiv(N, 32), triton.cdiv(K, 128))
    _dequantize_kernel[grid](weight, scale, row_scale if row_scale is not None else scale, out, N, K,
                             weight.stride(0), scale.stride(0), out.stride(0), scale_block[0], scale_block[1],
                             FMT=NVFP4_CODE if fmt == "nvfp4" else FP8_CODE, BLOCK_N=32, BLOCK_K=128,
                             ASM=weight.is_cuda, num_warps=4)
    return out


# -- FP8 W8A8 (prefill) -------------------------------------------------------------------------------

FP8_MAX = 448.0


def quantize_activations(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] (K a multiple of block) -> (fp8 [M, K], fp32 scales [M, K/block]): dynamic, per token and block."""
    M, K = x.shape
    g = x.view(M, K // block, block).float()
    scale = (g.abs().amax(-1) / FP8_MAX).clamp_(min=1e-12)
    q = (g / scale[..., None]).to(torch.float8_e4m3fn).view(M, K)
    return q, scale


_BLOCKWISE_OK: dict[int, bool] = {}


def _blockwise_available(device: torch.device) -> bool:
    """Whether this torch runs the 1x128 x 128x128 block-scaled FP8 GEMM here (probed once)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _BLOCKWISE_OK:
        try:
            a = torch.zeros(16, 512, dtype=torch.bfloat16, device=device)
            w = torch.zeros(256, 512, dtype=torch.float8_e4m3fn, device=device)
            _scaled_mm_blockwise(a, w, torch.ones(2, 4, device=device))
            _BLOCKWISE_OK[idx] = True
        except Exception as e:  # noqa: BLE001 - no such kernel in this torch/cuBLAS: fall back
            import structlog
            structlog.get_logger(__name__).warning("fp8_prefill_blockwise_unavailable", error=str(e)[-300:],
                                                   fallback="dequantize then cuBLAS")
            _BLOCKWISE_OK[idx] = False
    return _BLOCKWISE_OK[idx]


def _scaled_mm_blockwise(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, fused: bool = True) -> torch.Tensor:
    # x: [M, K] bf16; weight: fp8 [N, K]; scale_inv: fp32 [N/128, K/128] -> [M, N]
    import torch.nn.functional as F
    M = x.shape[0]
    if fused and x.is_cuda:
        from engine.kernels.linear.act_quant import quantize_activations_fused
        a, sa = quantize_activations_fused(x)                  # rows padded to a multiple of 4
    else:
        pad = -M % 4
        a, sa = quantize_activations(F.pad(x, (0, 0, 0, pad)) if pad else x)
        sa = sa.t().contiguous().t()
    kb = scale_inv.shape[1]
    sw = F.pad(scale_inv, (0, -kb % 4)) if kb % 4 else scale_inv
    out = F.scaled_mm(a, weight.t(), sa, F.ScalingType.BlockWise1x128, sw.t(),
                      F.ScalingType.BlockWise128x128, output_dtype=x.dtype)
    return out[:M] if out.shape[0] != M else out


# -- the layer's entry -------------------------------------------------------------------------------

# FP8 prefill (more than SKINNY_MAX_ROWS rows): "triton" (engine/kernels/linear/fp8_block_gemm.py), "cublas" (torch's
# block-scaled GEMM) or "dequantize" (bf16 weight, then cuBLAS). Measured at 4k tokens on qwen3-8b qkv +
# gate_up (bench/results/2026-11-30-h200-kern/sync2): cublas with the fused activation quantization 1.19 ms,
# dequantize 1.59, the Triton GEMM 2.01, bf16 1.45.
FP8_PREFILL = "cublas"


def quant_linear(layer, x: torch.Tensor) -> torch.Tensor:
    # x: [..., in] bf16/fp16 -> [..., out] (other dtypes take the reference path in engine.quant.linear)
    import torch.nn.functional as F
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n, k = layer.out_features, layer.in_features
    fmt = layer.quant
    fp8 = fmt == "fp8"
    rows = x2.shape[0]
    # the layer's scales as every kernel below takes them: FP8 block scales, or NVFP4 group and per-row scales
    if fp8:
        scale, row_scale, block = layer.weight_scale_inv, None, layer.scale_block
    else:
        scale, row_scale, block = layer.weight_scale, layer.weight_scale_2, (128, 128)
    if rows in quant_gemv_mma.MMA_GEMV_ROWS[fmt] and quant_gemv_mma.takes(fmt, x2, n, block):
        y = quant_gemv_mma.quant_gemv_mma(x2, fmt, layer.weight, scale, row_scale, n, block)
    elif gemv.use_gemv(fmt, rows) and (not fp8 or block[1] % 16 == 0):
        y = gemv.gemv(x2, fmt, layer.weight, scale, row_scale, n, block)
    elif rows <= SKINNY_MAX_ROWS:
        y = skinny(x2, fmt, layer.weight, scale, row_scale, n, block)
    elif fp8 and FP8_PREFILL == "triton" and k % 128 == 0 and block[1] == 128:
        from engine.kernels.linear.act_quant import quantize_activations_fused
        from engine.kernels.linear.fp8_block_gemm import fp8_block_gemm
        a, sa = quantize_activations_fused(x2, row_multiple=1)
        y = fp8_block_gemm(a, sa, layer.weight, scale, x2.dtype, scale_block=block)
    elif (fp8 and FP8_PREFILL != "dequantize" and block == (128, 128) and k % 128 == 0 and n % 128 == 0
          and _blockwise_available(x2.device)):
        y = _scaled_mm_blockwise(x2, layer.weight, scale)
    else:
        y = F.linear(x2, dequantize(fmt, layer.weight, scale, row_scale, n, k, x2.dtype, block))
    return y.view(*shape[:-1], n)
