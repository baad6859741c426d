"""Matmuls of quantized linear layers on CUDA: y[M, N] = x[M, K] @ W[N, K]^T.

  wxa16     decode (and NVFP4 prefill): W tiles dequantized in registers to the activation dtype,
            tensor-core dots, fp32 accumulation. FP8 blocks: e4m3 -> bf16 is exact and the block
            scale multiplies each K-block's partial dot. NVFP4: each E2M1 code is put in the bits of
            an fp16 number, 2^-14 times its value (exponent 0 is fp16's subnormal, so 0 and 0.5 come
            out right with no table), times its E4M3 group scale (and 2^14) in fp32 -- exact in
            bf16 -- and the per-row tensor scale multiplies the accumulator once at the end.
            Few output tiles (batch-1 decode of a narrow layer) split K over programs: fp32
            partials summed after.
  w8a8      FP8 prefill: activations quantized per token and 128-column block (dynamic scales,
            `quantize_activations`), fp8 x fp8 dots on the tensor cores, both scales applied per
            K-block.
Grids depend on shapes only (CUDA-graph safe); nothing here talks to other ranks (TP shards are
plain local layers). The reference every kernel is held to is `engine.quant.formats`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

NVFP4_CODE, FP8_CODE = 1, 0


@triton.jit
def _e2m1_times_2p14(c):
    # c: int32 codes 0..15 -> float32 value * 2^-14 via fp16 bits (sign 15, exponent 10..14, mantissa 9)
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _wxa16_kernel(x_ptr, w_ptr, s_ptr, rs_ptr, o_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                  stride_om, stride_osplit, k_per_split, scale_br, scale_bc,
                  FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & (offs_k[None, :] < k_end), other=0.0)
        if FMT == 1:
            offs_p = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            p = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_p[None, :],
                        mask=n_ok[:, None] & (offs_p[None, :] < k_end // 2), other=0).to(tl.int32)
            v = tl.join(_e2m1_times_2p14(p & 15), _e2m1_times_2p14(p >> 4))          # [BN, BK/2, 2]
            v = tl.reshape(v, (BLOCK_N, BLOCK_K // 16, 16))
            offs_g = k0 // 16 + tl.arange(0, BLOCK_K // 16)
            s = tl.load(s_ptr + offs_n[:, None].to(tl.int64) * stride_sn + offs_g[None, :],
                        mask=n_ok[:, None] & (offs_g[None, :] < k_end // 16), other=0.0).to(tl.float32)
            w = tl.reshape(v * (s * 16384.0)[:, :, None], (BLOCK_N, BLOCK_K)).to(dt)
            acc += tl.dot(x, tl.trans(w))
        else:
            w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                        mask=n_ok[:, None] & (offs_k[None, :] < k_end), other=0.0).to(dt)
            s = tl.load(s_ptr + (offs_n // scale_br) * stride_sn + k0 // scale_bc, mask=n_ok, other=0.0)
            acc += tl.dot(x, tl.trans(w)) * s[None, :]
    if FMT == 1:
        acc *= tl.load(rs_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    o = o_ptr + pid_k.to(tl.int64) * stride_osplit + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o, acc.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 0          # 0 = choose so that the grid fills the GPU


_SMS: dict[int, int] = {}


def _sms(device: torch.device) -> int:
    if device.type != "cuda":                            # Triton's interpreter (tests on a CPU)
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def default_config(fmt: str, M: int) -> GemmConfig:
    """Launch shapes by format and rows (tools/quant_kernels_check.py sweeps them on the GPU)."""
    if M <= 16:
        return GemmConfig(16, 32, 256 if fmt == "nvfp4" else 128, 4, 4)
    if M <= 64:
        return GemmConfig(64, 64, 128, 4, 3)
    return GemmConfig(128, 128, 64 if fmt == "fp8" else 128, 8, 3)


def wxa16(x: torch.Tensor, fmt: str, weight: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor | None,
          out_features: int, scale_block: tuple[int, int] = (128, 128), config: GemmConfig | None = None) -> torch.Tensor:
    """x: [M, K] bf16/fp16; weight: fp8 [N, K] or packed uint8 [N, K/2]; scale: fp32 [N/br, K/bc] or
    fp8 [N, K/16]; row_scale: fp32 [N] (NVFP4) -> [M, N] in x's dtype."""
    M, K = x.shape
    N = out_features
    cfg = config or default_config(fmt, M)
    bk = cfg.block_k if fmt == "nvfp4" else min(cfg.block_k, scale_block[1])
    grid_mn = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    k_blocks = triton.cdiv(K, bk)
    split = cfg.split_k or max(1, min(k_blocks, 8, (2 * _sms(x.device)) // grid_mn))
    k_per_split = triton.cdiv(k_blocks, split) * bk
    split = triton.cdiv(K, k_per_split)
    if split == 1:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
        stride_split = 0
    else:
        out = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
        stride_split = out.stride(0)
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n), split)
    _wxa16_kernel[grid](x, weight, scale, row_scale if row_scale is not None else scale, out, M, N, K,
                        x.stride(0), weight.stride(0), scale.stride(0), N, stride_split, k_per_split,
                        scale_block[0], scale_block[1], FMT=NVFP4_CODE if fmt == "nvfp4" else FP8_CODE,
                        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out if split == 1 else out.sum(0).to(x.dtype)


# -- FP8 W8A8 (prefill) -------------------------------------------------------------------------------

FP8_MAX = 448.0


def quantize_activations(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (fp8 [M, K], fp32 scales [M, ceil(K/block)]): dynamic, per token and K-block."""
    M, K = x.shape
    pad = -K % block
    xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
    g = xp.view(M, -1, block).float()
    scale = (g.abs().amax(-1) / FP8_MAX).clamp_(min=1e-12)
    q = (g / scale[..., None]).to(torch.float8_e4m3fn).view(M, -1)[:, :K]
    return q, scale


@triton.jit
def _w8a8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, o_ptr, M, N, K, stride_am, stride_asm, stride_wn, stride_wsn,
                 stride_om, scale_br, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    # grouped order: neighbouring programs share W tiles in L2
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        sa = tl.load(as_ptr + offs_m * stride_asm + k0 // 128, mask=m_ok, other=0.0)
        sw = tl.load(ws_ptr + (offs_n // scale_br) * stride_wsn + k0 // 128, mask=n_ok, other=0.0)
        acc += tl.dot(a, tl.trans(w)) * sa[:, None] * sw[None, :]
    o = o_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o, acc.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def w8a8(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, scale_block: tuple[int, int],
         config: GemmConfig | None = None) -> torch.Tensor:
    """x: [M, K] bf16; weight fp8 [N, K] with 128-column blocks -> [M, N] in x's dtype."""
    if scale_block[1] != 128:
        raise ValueError("w8a8 needs 128-column weight blocks")
    cfg = config or GemmConfig(128, 128, 128, 8, 4)
    M, K = x.shape
    N = weight.shape[0]
    a, sa = quantize_activations(x)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _w8a8_kernel[grid](a, sa, weight, scale_inv, out, M, N, K, a.stride(0), sa.stride(0), weight.stride(0),
                       scale_inv.stride(0), out.stride(0), scale_block[0], BLOCK_M=cfg.block_m,
                       BLOCK_N=cfg.block_n, BLOCK_K=128, GROUP_M=8, num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages)
    return out


# -- the layer's entry -------------------------------------------------------------------------------

# rows above which FP8 prefill takes the W8A8 path (the activations quantized once per call)
W8A8_MIN_ROWS = 128


def quant_linear(layer, x: torch.Tensor) -> torch.Tensor:
    # x: [..., in] -> [..., out]
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.dtype not in (torch.bfloat16, torch.float16):
        from engine.quant.linear import dequantized_weight
        return torch.nn.functional.linear(x, dequantized_weight(layer).to(x.dtype))
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = layer.out_features
    if layer.quant == "fp8":
        if x2.shape[0] >= W8A8_MIN_ROWS and layer.scale_block[1] == 128:
            y = w8a8(x2, layer.weight, layer.weight_scale_inv, layer.scale_block)
        else:
            y = wxa16(x2, "fp8", layer.weight, layer.weight_scale_inv, None, n, layer.scale_block)
    else:
        y = wxa16(x2, "nvfp4", layer.weight, layer.weight_scale, layer.weight_scale_2, n)
    return y.view(*shape[:-1], n)
