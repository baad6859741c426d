"""The reference (de)quantizers against values computed by hand from the format descriptions."""

from __future__ import annotations

import pytest
import torch

from engine.quant import formats as F


def test_every_e2m1_code_has_its_value():
    # sign | exponent (2 bits, bias 1) | mantissa; exponent 0 is subnormal: 0.5 * mantissa
    by_hand = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert F.e2m1_values().tolist() == by_hand
    for code in range(16):
        sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
        mag = 0.5 * man if exp == 0 else 2.0 ** (exp - 1) * (1 + 0.5 * man)
        assert F.e2m1_values()[code].item() == (-mag if sign else mag)


def test_even_column_is_the_low_nibble():
    packed = torch.tensor([[0x21, 0xF7]], dtype=torch.uint8)
    assert F.unpack_e2m1(packed).tolist() == [[1, 2, 7, 15]]
    assert F.pack_e2m1(torch.tensor([[1, 2, 7, 15]], dtype=torch.uint8)).tolist() == [[0x21, 0xF7]]
    # codes 1, 2, 7, 15 are 0.5, 1, 6, -6; one group of 16 with scale 2 and tensor scale 0.25
    weight = torch.zeros(1, 8, dtype=torch.uint8)
    weight[0, :2] = packed[0]
    scale = torch.tensor([[2.0]]).to(F.FP8)
    w = F.dequantize_nvfp4(weight, scale, torch.tensor(0.25))
    assert w[0, :4].tolist() == [0.25, 0.5, 3.0, -3.0]
    assert w[0, 4:].abs().sum().item() == 0


def test_nvfp4_group_scales_apply_per_16_columns():
    weight = torch.full((2, 16), 0x22, dtype=torch.uint8)          # every value 1.0
    scale = torch.tensor([[1.0, 0.5], [4.0, 448.0]]).to(F.FP8)
    w = F.dequantize_nvfp4(weight, scale, 2.0)
    assert w[0, :16].unique().tolist() == [2.0] and w[0, 16:].unique().tolist() == [1.0]
    assert w[1, :16].unique().tolist() == [8.0] and w[1, 16:].unique().tolist() == [896.0]


def test_round_to_e2m1_nearest_ties_to_even_mantissa():
    x = torch.tensor([0.0, 0.2, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 9.0, -0.25, -0.3, -2.6])
    values = F.e2m1_values()[F.round_to_e2m1(x).long()]
    assert values.tolist() == [0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 0.0, -0.5, -3.0]
    assert F.round_to_e2m1(torch.tensor([-0.1])).item() == 0      # no negative zero code


def test_fp8_block_scales_cover_128_by_128_and_ragged_edges():
    weight = torch.ones(130, 260).to(F.FP8)
    scale_inv = torch.arange(1.0, 7.0).view(2, 3)                  # [ceil(130/128), ceil(260/128)]
    w = F.dequantize_fp8_block(weight, scale_inv)
    assert w[0, 0] == 1 and w[127, 127] == 1 and w[0, 128] == 2 and w[0, 259] == 3
    assert w[128, 0] == 4 and w[129, 130] == 5 and w[129, 259] == 6


def test_fp8_quantize_round_trip_error_is_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(256, 384)
    q, s = F.quantize_fp8_block(w)
    assert q.dtype == F.FP8 and s.shape == (2, 3)
    assert torch.allclose(s, F._block_amax(w, (128, 128)) / 448)
    back = F.dequantize_fp8_block(q, s)
    # E4M3 has 3 mantissa bits: relative error of a normal number <= 2^-4
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + s.max() * 2 ** -9).all()
    assert back.abs().max() == pytest.approx(w.abs().max().item(), rel=1e-6)   # the amax is exact


def test_nvfp4_quantize_follows_the_modelopt_recipe():
    torch.manual_seed(1)
    w = torch.randn(32, 64)
    packed, scale, scale_2 = F.quantize_nvfp4(w)
    assert packed.shape == (32, 32) and packed.dtype == torch.uint8
    assert scale.shape == (32, 4) and scale.dtype == F.FP8 and scale_2.shape == ()
    assert scale_2.item() == pytest.approx(w.abs().max().item() / (6 * 448))
    back = F.dequantize_nvfp4(packed, scale, scale_2)
    step = scale.float().repeat_interleave(16, 1) * scale_2
    # every value lies on the grid and within half of the widest E2M1 gap (2, between 4 and 6) times its step
    assert ((back - w).abs() <= step * 1.0 + 1e-7).all()
    rel = (back - w).norm() / w.norm()
    assert rel < 0.15
    # a value exactly on the grid survives
    exact = torch.zeros(1, 16)
    exact[0, :4] = torch.tensor([6.0, -3.0, 0.5, 1.5])
    p, s, s2 = F.quantize_nvfp4(exact)
    assert torch.allclose(F.dequantize_nvfp4(p, s, s2), exact, rtol=1e-6, atol=0)   # up to the fp32 product


def test_zero_blocks_quantize_to_zero():
    w = torch.zeros(128, 128)
    q, s = F.quantize_fp8_block(w)
    assert F.dequantize_fp8_block(q, s).abs().sum() == 0
    p, s1, s2 = F.quantize_nvfp4(torch.zeros(4, 32))
    assert F.dequantize_nvfp4(p, s1, s2).abs().sum() == 0


def test_nvfp4_scale_search_never_loses_and_sometimes_clips():
    torch.manual_seed(3)
    w = torch.randn(64, 128) * torch.rand(64, 1) * 3
    plain = F.dequantize_nvfp4(*F.quantize_nvfp4(w))
    p, s, s2 = F.quantize_nvfp4(w, search=(0.9, 0.8))
    searched = F.dequantize_nvfp4(p, s, s2)
    per_group = lambda x: ((x - w) ** 2).view(64, 8, 16).sum(-1)    # noqa: E731
    assert (per_group(searched) <= per_group(plain) + 1e-12).all()
    assert (per_group(searched) < per_group(plain)).any()
    # a clipped group's largest value no longer comes back whole
    assert (searched.abs().view(64, 8, 16).amax(-1) < plain.abs().view(64, 8, 16).amax(-1) - 1e-6).any()
