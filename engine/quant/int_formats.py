"""Integer weight-only formats (GPTQ, AWQ, compressed-tensors pack-quantized): the layout a layer holds,
its reference dequantizer, and the bit packing every checkpoint layout is converted from.

The layer's layout (one for every producer; `engine.quant.layouts` converts each checkpoint into it):
    qweight  int32   [out, in * bits / 32]  unsigned codes u in [0, 2^bits), packed along the INPUT dim:
                                            column k in word k // (32 / bits) at bit (k % (32 / bits)) * bits,
                                            least-significant field first (the order the kernels unpack)
    scales   float32 [out, groups]          one per row and group of `group_size` input columns
    zeros    float32 [out, groups]          the code of zero (an integer): 2^(bits-1) for symmetric schemes
    g_idx    int32   [in]                   act-order checkpoints only (GPTQ desc_act): the group of each
                                            input column; without it column k is in group k // group_size
    W[o, k] = (u[o, k] - zeros[o, g(k)]) * scales[o, g(k)]

group_size 0 means one group per row (per-channel scales: GPTQ group_size -1, compressed-tensors
strategy "channel").
"""

from __future__ import annotations

import torch

# AWQ GEMM packing: nibble j of a word holds output column AWQ_ORDER[j] of its group of 8
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_factor(bits: int) -> int:
    return 32 // bits


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned `bits`-wide fields of int32 words along `dim` -> int32 values in [0, 2^bits), that dim
    32 / bits times longer (least-significant field first)."""
    per = pack_factor(bits)
    p = packed.to(torch.int32).movedim(dim, -1)
    shifts = torch.arange(per, dtype=torch.int32, device=p.device) * bits
    fields = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)                 # [..., words, per]
    return fields.reshape(*p.shape[:-1], p.shape[-1] * per).movedim(-1, dim)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of `unpack_int32`: values in [0, 2^bits) along `dim` (a multiple of 32 / bits) -> int32 words."""
    per = pack_factor(bits)
    v = values.to(torch.int64).movedim(dim, -1)
    if v.shape[-1] % per:
        raise ValueError(f"packing {bits}-bit values needs a multiple of {per} along dim {dim}, got {v.shape[-1]}")
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    shifts = torch.arange(per, dtype=torch.int64, device=v.device) * bits
    words = (v << shifts).sum(-1)                                            # < 2^32: fits int64
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.movedim(-1, dim)


def unpack_awq_cols(packed: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM: int32 [rows, cols / 8] packed along columns in AWQ_ORDER -> int32 [rows, cols], natural order."""
    fields = unpack_int32(packed, 4, dim=1)
    rows, cols = fields.shape
    order = torch.tensor(AWQ_ORDER, device=packed.device)
    out = torch.empty_like(fields).view(rows, cols // 8, 8)
    out[:, :, order] = fields.view(rows, cols // 8, 8)
    return out.view(rows, cols)


def pack_awq_cols(values: torch.Tensor) -> torch.Tensor:
    """The inverse of `unpack_awq_cols` (tests write AWQ tensors with it)."""
    rows, cols = values.shape
    order = torch.tensor(AWQ_ORDER, device=values.device)
    return pack_int32(values.view(rows, cols // 8, 8)[:, :, order].reshape(rows, cols), 4, dim=1)


def group_index(in_features: int, group_size: int, g_idx: torch.Tensor | None, device=None) -> torch.Tensor:
    """int64 [in]: the group of every input column."""
    if g_idx is not None:
        return g_idx.long()
    if group_size == 0:
        return torch.zeros(in_features, dtype=torch.long, device=device)
    return torch.arange(in_features, device=device) // group_size


def dequantize_int(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int,
                   g_idx: torch.Tensor | None = None) -> torch.Tensor:
    # qweight: int32 [out, in*bits/32]; scales, zeros: [out, groups]; g_idx: [in] or None -> float32 [out, in]
    u = unpack_int32(qweight, bits, dim=1)
    g = group_index(u.shape[1], group_size, g_idx, u.device)
    return (u.float() - zeros.float()[:, g]) * scales.float()[:, g]


def quantize_int(w: torch.Tensor, bits: int, group_size: int, symmetric: bool) -> dict[str, torch.Tensor]:
    """Round to nearest with min/max (asymmetric) or absmax (symmetric) scales per group: w [out, in] ->
    the layer's tensors (qweight, scales, zeros) and its float32 dequantized twin `ref`. For tests and tools."""
    out, inp = w.shape
    g = group_size or inp
    groups = w.float().view(out, inp // g, g)
    top = (1 << bits) - 1
    if symmetric:
        zero = torch.full(groups.shape[:2], float(1 << (bits - 1)), device=w.device)
        scale = groups.abs().amax(-1) / (1 << (bits - 1))
    else:
        lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = (hi - lo) / top
        zero = torch.round(-lo / torch.where(scale > 0, scale, torch.ones_like(scale)))
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    u = torch.clamp(torch.round(groups / scale[..., None]) + zero[..., None], 0, top).view(out, inp)
    qweight = pack_int32(u.to(torch.int32), bits, dim=1)
    result = {"qweight": qweight, "scales": scale, "zeros": zero}
    result["ref"] = dequantize_int(qweight, scale, zero, bits, group_size)
    return result
