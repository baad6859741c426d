"""Reference (de)quantizers for the two weight formats, written from their descriptions.

NVFP4 (NVIDIA ModelOpt, `quant_algo: NVFP4`, `group_size: 16`), one linear layer [out, in]:
    weight          uint8          [out, in/2]   two E2M1 codes per byte; column 2j in the LOW nibble,
                                                 column 2j+1 in the high nibble
    weight_scale    float8_e4m3fn  [out, in/16]  one scale per 16 consecutive input columns
    weight_scale_2  float32        scalar        one scale for the whole tensor
    input_scale     float32        scalar        activations' scale for W4A4 (unused by W4A16)
    W[r, c] = e2m1(code[r, c]) * float(weight_scale[r, c // 16]) * weight_scale_2

E2M1 code (4 bits): bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa; exponent 0 is
subnormal (0 or 0.5). Magnitudes of codes 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6.

FP8 block (Qwen3-*-FP8, `quant_method: fp8`, `weight_block_size: [128, 128]`):
    weight            float8_e4m3fn  [out, in]
    weight_scale_inv  float32        [ceil(out/128), ceil(in/128)]
    W[r, c] = float(weight[r, c]) * weight_scale_inv[r // 128, c // 128]
(The name says "inverse" because the quantizer divided by its reciprocal; the stored number is the
factor that dequantizes.)

These functions are the yardstick for the loaders, the layer methods and the Triton kernels; they
favour plainness over speed.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_GROUP = 16
FP8_BLOCK = (128, 128)

# magnitude of E2M1 codes 0..7; codes 8..15 are the same values negated
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


_E2M1_VALUES: dict[torch.device, torch.Tensor] = {}


def e2m1_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [16]: the value of every 4-bit code, on `device`. Kept per device: a CUDA graph that runs
    the reference path (float32 engines) must find it there, since capture allows no host copy."""
    device = torch.device(device)
    values = _E2M1_VALUES.get(device)
    if values is None:
        mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
        values = _E2M1_VALUES[device] = torch.cat([mags, -mags]).to(device)
    return values


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    # packed: uint8 [rows, cols/2] -> codes uint8 [rows, cols], even column from the low nibble
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    # codes: uint8 [rows, cols] (cols even), values 0..15 -> uint8 [rows, cols/2]
    if codes.shape[-1] % 2:
        raise ValueError(f"E2M1 packing needs an even number of columns, got {codes.shape[-1]}")
    pairs = codes.view(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Codes (uint8) of the E2M1 values nearest to x (float), ties to the even mantissa, saturating
    at +-6. Midpoints between neighbours: 0.25 0.75 1.25 1.75 2.5 3.5 5."""
    mags = x.abs().float().clamp(max=E2M1_MAX)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=x.device)
    idx = torch.bucketize(mags, mids)               # a tie goes to the lower neighbour here ...
    odd_below = torch.tensor([0.75, 1.75, 3.5], device=x.device)
    idx = idx + torch.isin(mags, odd_below).to(idx.dtype)   # ... unless the lower one's mantissa is odd
    sign = ((x < 0) & (idx > 0)).to(torch.uint8) << 3
    return idx.to(torch.uint8) | sign


def dequantize_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor | float,
                     group: int = NVFP4_GROUP) -> torch.Tensor:
    # weight: uint8 [out, in/2]; weight_scale: fp8 [out, in/group]; weight_scale_2: scalar -> float32 [out, in]
    codes = unpack_e2m1(weight).long()
    values = e2m1_values(weight.device)[codes]
    scales = weight_scale.float().repeat_interleave(group, dim=1)[:, :values.shape[1]]
    if isinstance(weight_scale_2, (int, float)):            # no host-to-device copy (graph capture)
        return values * scales * float(weight_scale_2)
    return values * scales * weight_scale_2.to(device=weight.device, dtype=torch.float32)


def dequantize_fp8_block(weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                         block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    # weight: fp8 [out, in]; weight_scale_inv: float32 [ceil(out/br), ceil(in/bc)] -> float32 [out, in]
    out, inp = weight.shape
    scales = weight_scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return weight.float() * scales[:out, :inp]


# -- quantizers: round to nearest with absmax scales ------------------------------------------------

def _block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    # w: [out, in] -> amax per block [ceil(out/br), ceil(in/bc)] (ragged edge blocks padded with 0)
    br, bc = block
    out, inp = w.shape
    padded = torch.nn.functional.pad(w.abs().float(), (0, -inp % bc, 0, -out % br))
    return padded.view(padded.shape[0] // br, br, padded.shape[1] // bc, bc).amax(dim=(1, 3))


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [out, in] -> (fp8 [out, in], weight_scale_inv float32 [ceil(out/br), ceil(in/bc)])."""
    amax = _block_amax(w, block)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:w.shape[0], :w.shape[1]]
    q = (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_nvfp4(w: torch.Tensor, group: int = NVFP4_GROUP,
                   search: tuple[float, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [out, in] (in a multiple of `group`) -> (uint8 [out, in/2], fp8 [out, in/group], float32 scalar).

    ModelOpt's recipe: the tensor scale puts the largest group scale at the top of E4M3,
    weight_scale_2 = amax(W) / (6 * 448); each group's scale amax(group) / 6 is stored in E4M3 relative
    to it, and the values are rounded to E2M1 against the stored (already rounded) group scale.

    `search` (optional calibration, off by default): further fractions of the absmax scale to try
    per group (e.g. 0.9, 0.8: clipping the largest value a little can lower the group's error); each
    group keeps the candidate with the smallest squared error."""
    out, inp = w.shape
    if inp % group:
        raise ValueError(f"NVFP4 needs in_features divisible by {group}, got {inp}")
    w = w.float()
    amax = w.abs().max()
    scale_2 = amax / (E2M1_MAX * FP8_MAX) if amax > 0 else torch.tensor(1.0, device=w.device)
    groups = w.view(out, inp // group, group)
    best = best_err = None
    for fraction in (1.0, *search):
        cand = _nvfp4_groups(groups, groups.abs().amax(dim=-1) * fraction, scale_2)
        err = ((_nvfp4_values(*cand, scale_2) - groups) ** 2).sum(-1)                  # [out, in/g]
        if best is None:
            best, best_err = cand, err
        else:
            better = err < best_err
            best = tuple(torch.where(better[..., None] if x.dim() == 3 else better, x, y) for x, y in zip(cand, best))
            best_err = torch.minimum(err, best_err)
    codes, group_scale = best
    return pack_e2m1(codes.view(out, inp)), group_scale, scale_2.float().reshape(())


def _nvfp4_groups(groups: torch.Tensor, group_amax: torch.Tensor, scale_2: torch.Tensor):
    # groups: [out, in/g, g]; group_amax: [out, in/g] -> (codes uint8 [out, in/g, g], E4M3 scales [out, in/g])
    group_scale = (group_amax / E2M1_MAX / scale_2).clamp(max=FP8_MAX).to(FP8)
    step = group_scale.float().unsqueeze(-1) * scale_2
    scaled = torch.where(step > 0, groups / torch.where(step > 0, step, torch.ones_like(step)), torch.zeros_like(groups))
    return round_to_e2m1(scaled), group_scale


def _nvfp4_values(codes: torch.Tensor, group_scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    return e2m1_values(codes.device)[codes.long()] * group_scale.float().unsqueeze(-1) * scale_2
