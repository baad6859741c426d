"""The tensor-core quantized decode GEMV (engine/kernels/linear/quant_gemv_mma.py, CUDA C through CuPy) against the
reference dequantizer, on a CUDA device (marked gpu). The bound is bf16 output rounding (2^-8 of the largest
output), as for the Triton kernels (tests/engine/kernels/linear/test_quant_kernels.py); tools/dev/quant_gemv_mma_check.py holds the checks."""

from __future__ import annotations

import importlib.util

import pytest
import torch

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="needs CuPy (the gpu extra)")]
TOL = 2 ** -8

# (M, N, K): qwen3-8b qkv / down, a TP=2 shard, qwen3-32b's down at M=2, the smallest whole shapes
SHAPES = [(1, 6144, 4096), (2, 4096, 12288), (3, 2048, 6144), (8, 6144, 4096), (2, 5120, 25600), (1, 48, 128)]


@pytest.fixture(scope="module")
def chk():
    from tools.dev import quant_gemv_mma_check
    return quant_gemv_mma_check


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_matches_the_reference(chk, fmt, shape):
    r = chk.check(fmt, *shape, seed=sum(shape))
    assert r["nan"] == 0 and r["rel_err"] < TOL, r


@pytest.mark.parametrize("variant", [(8, 4, True), (16, 2, True), (16, 4, False)], ids=["w8u4c", "w16u2c", "w16u4"])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_every_chunk_order_matches_the_reference(chk, fmt, variant):
    """The warps' chunk orders (interleaved, or batches of adjacent chunks), including K whose chunk count is
    not a whole number of batches (which falls back to the interleaved order)."""
    warps, batch, contig = variant
    for m, n, k in ((2, 4096, 12288), (3, 2048, 6144), (1, 128, 384 if fmt == "fp8" else 640)):
        r = chk.check(fmt, m, n, k, seed=m + n, warps=warps, batch=batch, contig=contig)
        assert r["nan"] == 0 and r["rel_err"] < TOL, (m, n, k, r)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_fp16_activations(chk, fmt):
    r = chk.check(fmt, 4, 4096, 4096, dtype=torch.float16, seed=9)
    assert r["nan"] == 0 and r["rel_err"] < TOL, r


def test_fp8_small_scale_blocks(chk):
    """64x64 FP8 blocks: a TP rank's slice that starts inside a 128 block."""
    r = chk.check("fp8", 3, 256, 1024, block=(64, 64), seed=4)
    assert r["rel_err"] < TOL, r


def test_nvfp4_every_e4m3_scale(chk):
    """Random codes with group scales over E4M3's whole range, subnormals included (the scaled fp16 A
    operand is exact for all of them), against a float64 reference."""
    assert chk.check_full_range_scales()["rel_err"] < TOL


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_cuda_graph_replay(chk, fmt):
    r = chk.check_graph(fmt)
    assert r["replay_equals_eager"] and r["changed"], r


def test_unsupported_shapes_are_refused_and_routed_elsewhere():
    from engine.kernels.linear import quant_gemv_mma as mma
    assert not mma.supports("nvfp4", 1, 4096, 4160)         # K not a whole number of 128-column chunks
    assert not mma.supports("nvfp4", 9, 4096, 4096)         # more rows than the mma has columns
    assert not mma.supports("fp8", 1, 4100, 4096)           # N not a whole number of 16-row blocks
    assert not mma.supports("fp8", 1, 4096, 4096, (128, 96))
    x = torch.zeros(1, 4160, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not supported"):
        mma.quant_gemv_mma(x, "nvfp4", torch.zeros(4096, 2080, dtype=torch.uint8, device="cuda"),
                           torch.zeros(4096, 260, dtype=torch.uint8, device="cuda"), None, 4096)
