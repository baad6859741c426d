"""The parameters and the forward of a quantized linear layer (see `engine.layers.linear`).

NVFP4 layer, out/in local to the rank:
    weight          uint8 [out, in/2]      the checkpoint's packed E2M1 codes
    weight_scale    fp8   [out, in/16]     the checkpoint's group scales
    weight_scale_2  fp32  [out]            the checkpoint's per-tensor scale, copied to every row of
                                           its part: fused q/k/v and gate/up keep each part's own
                                           scale exactly (no re-rounding of the E4M3 group scales);
                                           a kernel applies it to each output once
FP8 block layer:
    weight            fp8  [out, in]
    weight_scale_inv  fp32 [ceil(out/br), ceil(in/bc)]
where (br, bc) is the checkpoint's 128x128 block unless a fused part or a rank's slice starts inside
a block (small models under TP): then the block scales are repeated to the largest granule that
every slice starts on, so a rank never holds part of a scale block.

On the CPU the layer dequantizes with the reference (`engine.quant.formats`) and multiplies; on CUDA
it runs the Triton kernels of `engine.kernels.linear.quant_gemm`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.quant import formats
from engine.quant.scheme import FP8, NVFP4


def _param(shape, dtype, **attrs) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.quantized = True                                  # stored as is: no cast to the model dtype
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def create_weights(layer: nn.Module, fmt: str, in_features: int, out_features: int, row_granule: int,
                   cols_sharded: bool) -> None:
    if fmt == NVFP4:
        g = formats.NVFP4_GROUP
        if in_features % g:
            raise ModelLoadError(f"NVFP4: in_features {in_features} per rank is not a multiple of group_size {g}")
        layer.weight = _param((out_features, in_features // 2), torch.uint8, col_div=2)
        layer.weight_scale = _param((out_features, in_features // g), formats.FP8, col_div=g)
        layer.weight_scale_2 = _param((out_features,), torch.float32)
    elif fmt == FP8:
        bR, bC = formats.FP8_BLOCK
        br = math.gcd(bR, row_granule)
        bc = math.gcd(bC, in_features) if cols_sharded else bC
        layer.scale_block = (br, bc)
        layer.weight = _param((out_features, in_features), formats.FP8)
        layer.weight_scale_inv = _param((-(-out_features // br), -(-in_features // bc)), torch.float32,
                                        row_div=br, col_div=bc,
                                        expand_loaded=lambda s: s.repeat_interleave(bR // br, 0)
                                        .repeat_interleave(bC // bc, 1))
    else:
        raise ModelLoadError(f"unknown quantized format {fmt!r}")
    for p in layer.parameters(recurse=False):
        p.weight_loader = layer.weight_loader


def dequantized_weight(layer: nn.Module) -> torch.Tensor:
    """The layer's local weight in float32 [out, in], by the reference dequantizer."""
    if layer.quant == NVFP4:
        return formats.dequantize_nvfp4(layer.weight, layer.weight_scale, 1.0) * layer.weight_scale_2[:, None]
    return formats.dequantize_fp8_block(layer.weight, layer.weight_scale_inv, layer.scale_block)


def apply(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # x: [T, in] -> [T, out]
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _has_quant_kernels(layer, x.device):
        from engine.kernels.linear import quant_gemm
        return quant_gemm.quant_linear(layer, x)
    # the CPU, and GPUs without an e4m3 decode (below sm89, engine/platform.py): weight-only, dequantized by torch
    return F.linear(x, dequantized_weight(layer).to(x.dtype))


def _has_quant_kernels(layer: nn.Module, device: torch.device) -> bool:
    from engine.platform import paths_for
    paths = paths_for(device)
    return (paths.nvfp4_linear if layer.quant == NVFP4 else paths.fp8_linear) != "torch-dequantize"
