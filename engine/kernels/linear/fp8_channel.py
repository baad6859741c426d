"""FP8 layers with one scale per output row (compressed-tensors strategy channel, `--quantization ptpc_fp8`), on
the FP8 kernels the repository has: a per-row scale is a block scale of 1 row by all K columns.

  decode (M <= SKINNY_MAX_ROWS)  quant_gemm.skinny with (1, K) scale blocks: the row's scale multiplies each
                                 K tile's partial dot in the accumulator
  prefill                        torch's row-wise scaled FP8 GEMM (activations quantized per token, the
                                 weight's per-row scales: cuBLAS) where this torch and GPU have it;
                                 otherwise quant_gemm.dequantize with (1, K) blocks, then cuBLAS in bf16
The decode GEMVs of gemv.py / quant_gemv_mma.py take 128-row scale blocks (a program's rows share one scale
row): per-channel scales would need their own variant, measured on the GPU before it replaces skinny.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.linear import quant_gemm

_ROWWISE_OK: dict[int, bool] = {}


def _rowwise_available(device: torch.device) -> bool:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _ROWWISE_OK:
        try:
            a = torch.zeros(16, 64, dtype=torch.bfloat16, device=device)
            _scaled_mm_rowwise(a, torch.zeros(32, 64, dtype=torch.float8_e4m3fn, device=device),
                               torch.ones(32, device=device))
            _ROWWISE_OK[idx] = True
        except Exception as e:  # noqa: BLE001 - no such GEMM in this torch/cuBLAS/GPU: dequantize instead
            import structlog
            structlog.get_logger(__name__).warning("fp8_rowwise_unavailable", error=str(e)[-300:],
                                                   fallback="dequantize then cuBLAS")
            _ROWWISE_OK[idx] = False
    return _ROWWISE_OK[idx]


def _scaled_mm_rowwise(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # x: [M, K] bf16; weight: fp8 [N, K]; scale: fp32 [N] -> [M, N]
    sa = (x.float().abs().amax(1, keepdim=True) / quant_gemm.FP8_MAX).clamp_(min=1e-12)        # [M, 1]
    a = (x.float() / sa).to(torch.float8_e4m3fn)
    return F.scaled_mm(a, weight.t(), sa, F.ScalingType.RowWise, scale[None, :].float(), F.ScalingType.RowWise,
                       output_dtype=x.dtype)


def fp8_channel_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: [M, K] bf16/fp16; weight: fp8 [N, K]; scale: float32 [N] -> [M, N] in x's dtype."""
    M, K = x.shape
    N = weight.shape[0]
    # [N, 1] scales of (1, >= K) blocks: one per row over every column (>= 128 keeps the K tile a power of two)
    blocks, block = scale[:, None], (1, max(K, 128))
    if M <= quant_gemm.SKINNY_MAX_ROWS:
        return quant_gemm.skinny(x, "fp8", weight, blocks, None, N, block)
    if x.is_cuda and x.dtype == torch.bfloat16 and K % 16 == 0 and N % 16 == 0 and _rowwise_available(x.device):
        return _scaled_mm_rowwise(x, weight, scale)
    return F.linear(x, quant_gemm.dequantize("fp8", weight, blocks, None, N, K, x.dtype, block))


def fp8_channel_linear(layer, x: torch.Tensor) -> torch.Tensor:
    # x: [..., in] bf16/fp16 -> [..., out]
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return fp8_channel_matmul(x2, layer.weight, layer.weight_scale).view(*shape[:-1], layer.out_features)
