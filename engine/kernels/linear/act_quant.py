"""Dynamic FP8 quantization of activations per token and 128 columns, in one Triton pass (prefill W8A8).

The torch version (`quant_gemm.quantize_activations`: view, float, abs, amax, divide, cast, then a
transposed copy of the scales and a pad of the rows) reads and writes the activations several times;
this kernel reads each [BLOCK_M, 128] tile once and writes the FP8 values and one fp32 scale per row
and tile, the scales straight into the column-major [M_pad, K/128] layout that torch's block-scaled
GEMM takes for its 1x128 operand, and the rows from M to M_pad (a multiple of 4, as that GEMM needs)
as zeros. Same numbers as the torch version: scale = max(amax / 448, 1e-12), value = x / scale
rounded to nearest e4m3.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, Mp, stride_xm, stride_qm, stride_sk,
                      BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=(rows < M)[:, None],
                other=0.0).to(tl.float32)                                          # [BM, 128]
    # IEEE divisions (Triton's `/` is the approximate one): the same bits as the torch version
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=1), FP8_MAX), 1e-12)       # [BM]
    q = tl.div_rn(x, scale[:, None]).to(tl.float8e4nv)
    ok = rows < Mp
    tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], q, mask=ok[:, None])
    tl.store(s_ptr + tl.program_id(1).to(tl.int64) * stride_sk + rows, scale, mask=ok)


def quantize_activations_fused(x: torch.Tensor, block: int = 128, row_multiple: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] bf16/fp16 (K a multiple of block) -> (fp8 [Mp, K], fp32 scales [Mp, K/block] column-major),
    Mp = M rounded up to row_multiple (the extra rows are zeros with scale 1e-12)."""
    M, K = x.shape
    if K % block:
        raise ValueError(f"activation quantization needs K divisible by {block}, got {K}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    Mp = -(-M // row_multiple) * row_multiple
    q = torch.empty(Mp, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(K // block, Mp, dtype=torch.float32, device=x.device).t()       # column-major [Mp, K/block]
    bm = 16
    _act_quant_kernel[(triton.cdiv(Mp, bm), K // block)](x, q, s, M, Mp, x.stride(0), q.stride(0), s.stride(1),
                                                         BLOCK_M=bm, BLOCK=block, num_warps=4)
    return q, s
