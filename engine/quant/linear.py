"""The parameters and the forward of a quantized linear layer (see `engine.layers.linear`), by kind
(engine.quant.layouts.base). Shapes are local to the rank: out and in are its rows and columns.

NVFP4:
    weight          uint8 [out, in/2]      packed E2M1 codes
    weight_scale    fp8   [out, in/16]     group scales
    weight_scale_2  fp32  [out]            the checkpoint's per-tensor scale, copied to every row of
                                           its part: fused q/k/v and gate/up keep each part's own
                                           scale exactly (no re-rounding of the E4M3 group scales);
                                           a kernel applies it to each output once
FP8 blocks:
    weight            fp8  [out, in]
    weight_scale_inv  fp32 [ceil(out/br), ceil(in/bc)]
where (br, bc) is the checkpoint's 128x128 block unless a fused part or a rank's slice starts inside
a block (small models under TP): then the block scales are repeated to the largest granule that
every slice starts on, so a rank never holds part of a scale block. A per-tensor scale (ModelOpt FP8,
compressed-tensors strategy tensor) fills every block of its part.
FP8 per channel:
    weight        fp8  [out, in]
    weight_scale  fp32 [out]
Integer weight-only (engine.quant.int_formats; GPTQ, AWQ, compressed-tensors pack-quantized):
    qweight  int32 [out, in*bits/32]; scales, zeros fp32 [out, groups]; g_idx int32 [in] (act order)
    A row-parallel rank's columns must be whole groups (refused otherwise, naming the module); with act
    order every rank keeps all the groups' scales and zeros (its columns belong to any of them) and the
    g_idx of its own columns.

On the CPU the layer dequantizes with the reference and multiplies; on CUDA it runs the Triton kernels
(engine.kernels.linear: quant_gemm for FP8 blocks and NVFP4, fp8_channel, int_gemm).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.quant import formats, int_formats
from engine.quant.layouts.base import FP8, FP8_CHANNEL, INT, NVFP4, LinearQuant


def _param(shape, dtype, **attrs) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.quantized = True                                  # stored as is: no cast to the model dtype
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def create_weights(layer: nn.Module, quant: LinearQuant, in_features: int, out_features: int, row_granule: int,
                   cols_sharded: bool, ranks: int = 1) -> None:
    """The layer's quantized parameters; `ranks` splits the input columns when `cols_sharded` (row parallel)."""
    fmt = quant.kind
    if fmt == NVFP4:
        g = formats.NVFP4_GROUP
        if in_features % g:
            raise ModelLoadError(f"{quant.module}: NVFP4 in_features {in_features} per rank is not a multiple of "
                                 f"group_size {g}")
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
    elif fmt == FP8_CHANNEL:
        layer.weight = _param((out_features, in_features), formats.FP8)
        layer.weight_scale = _param((out_features,), torch.float32)
    elif fmt == INT:
        _create_int(layer, quant, in_features, out_features, cols_sharded, ranks)
    else:
        raise ModelLoadError(f"unknown quantized kind {fmt!r}")
    for p in layer.parameters(recurse=False):
        p.weight_loader = layer.weight_loader


def _create_int(layer: nn.Module, q: LinearQuant, inp: int, out: int, cols_sharded: bool, ranks: int) -> None:
    per, gs, name = int_formats.pack_factor(q.bits), q.group_size, q.module
    if inp % per:
        raise ModelLoadError(f"{name}.qweight: in_features {inp} per rank is not a multiple of {per} "
                             f"({q.bits}-bit codes in int32 words)")
    full_in = inp * ranks if cols_sharded else inp
    if q.act_order or gs == 0:
        # every rank keeps the scales of all the groups its columns may belong to
        groups, scale_attrs = (full_in // gs if gs else 1), {"cols_whole": True}
    else:
        if inp % gs:
            raise ModelLoadError(f"{name}.qweight: in_features {inp} per rank ({full_in} over {ranks} ranks) would cut "
                                 f"its groups of {gs} input columns; use fewer tensor-parallel ranks")
        groups, scale_attrs = inp // gs, {"col_div": gs}
    layer.bits, layer.group_size = q.bits, gs
    layer.qweight = _param((out, inp // per), torch.int32, col_div=per)
    layer.scales = _param((out, groups), torch.float32, **scale_attrs)
    # symmetric layouts without zero points (compressed-tensors) keep the code of zero, 2^(bits-1)
    layer.zeros = _param((out, groups), torch.float32, **scale_attrs)
    layer.zeros.data.fill_(float(1 << (q.bits - 1)))
    layer.g_idx = _param((inp,), torch.int32, along_cols=True) if q.act_order else None


def dequantized_weight(layer: nn.Module) -> torch.Tensor:
    """The layer's local weight in float32 [out, in], by the reference dequantizer."""
    if layer.quant == NVFP4:
        return formats.dequantize_nvfp4(layer.weight, layer.weight_scale, 1.0) * layer.weight_scale_2[:, None]
    if layer.quant == FP8_CHANNEL:
        return layer.weight.float() * layer.weight_scale[:, None]
    if layer.quant == INT:
        return int_formats.dequantize_int(layer.qweight, layer.scales, layer.zeros, layer.bits, layer.group_size,
                                          layer.g_idx)
    return formats.dequantize_fp8_block(layer.weight, layer.weight_scale_inv, layer.scale_block)


def apply(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # x: [T, in] -> [T, out]
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        if layer.quant == INT and _paths(x.device).int_linear == "triton-int-gemv+gemm":
            from engine.kernels.linear import int_gemm
            return int_gemm.int_linear(layer, x)
        if layer.quant == FP8_CHANNEL and _has_quant_kernels(layer, x.device):
            from engine.kernels.linear import fp8_channel
            return fp8_channel.fp8_channel_linear(layer, x)
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and layer.quant in (FP8, NVFP4) \
            and _has_quant_kernels(layer, x.device):
        from engine.kernels.linear import quant_gemm
        return quant_gemm.quant_linear(layer, x)
    # the CPU, GPUs without an e4m3 decode (below sm89) and any family engine/platform.py does not select on the
    # device (its start-up `kernel_paths` line says "torch-dequantize"): weight-only, dequantized by torch
    return F.linear(x, dequantized_weight(layer).to(x.dtype))


def _paths(device: torch.device):
    from engine.platform import paths_for
    return paths_for(device)


def _has_quant_kernels(layer: nn.Module, device: torch.device) -> bool:
    paths = _paths(device)
    return (paths.nvfp4_linear if layer.quant == NVFP4 else paths.fp8_linear) != "torch-dequantize"
