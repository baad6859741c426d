"""SwiGLU folded into the gate/up GEMV (engine.kernels.linear.gemv.gate_up_silu): one decode row of bf16 or FP8 block
weights against the unfused kernels it replaces (the GEMV, then silu_and_mul), and against float64 math. On a CUDA device (marked gpu), or
under Triton's interpreter on the CPU when NINFER_TRITON_INTERPRET_TESTS=1."""

from __future__ import annotations

import os

import pytest
import torch

from tests.support.kernel_backend import CUDA, DEV, INTERPRET, needs_a_backend  # noqa: F401 (sets TRITON_INTERPRET first)

pytestmark = needs_a_backend


@pytest.fixture(scope="module")
def kernels():
    from tests.support import kernel_checks
    if not CUDA:
        kernel_checks.patch_interpreter()
    from engine.kernels.elementwise import norm_rope as fused
    from engine.kernels.linear import gemv
    return gemv, fused


SHAPES = [(24576, 4096), (6144, 1024), (12290, 512)] if CUDA else [(64, 512), (36, 256), (10, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_gate_up_silu_equals_the_unfused_kernels(kernels, n, k, rows):
    # two rows: a k=1 verify or two streams, on the GEMV's two-row launch shape (word pairs, 4-row tiles)
    gemv, fused = kernels
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(DEV, torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(DEV, torch.bfloat16)
    got = gemv.gate_up_silu(x, w)
    unfused = fused.silu_and_mul(gemv.gemv(x, "bf16", w))
    assert got.shape == (rows, n // 2)
    # the same launch shape, so each row's sum runs in the same order; the same roundings after it: equal
    assert torch.equal(got, unfused)
    ref64 = x.double() @ w.double().T
    gate, up = ref64[:, :n // 2], ref64[:, n // 2:]
    ref = torch.nn.functional.silu(gate) * up
    assert (got.double() - ref).abs().max() <= ref.abs().max() * 2 ** -6


FP8_CASES = ([(24576, 4096, (128, 128)), (6144, 1024, (16, 128)), (12290, 512, (128, 128))] if CUDA
             else [(64, 512, (16, 128)), (36, 256, (16, 128)), (10, 256, (128, 128))])


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,block", FP8_CASES, ids=[f"{n}x{k}-b{b[0]}" for n, k, b in FP8_CASES])
def test_fp8_gate_up_silu_equals_the_unfused_kernels(kernels, n, k, block):
    # the gate rows and the up rows of one program read different rows of block scales where the block is
    # shorter than the gate part (b16); 12290 rows leave the last program half empty (masked)
    gemv, fused = kernels
    from engine.quant import formats
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g) * k ** -0.5
    w = w * torch.linspace(0.25, 4.0, n)[:, None]              # block scales that differ row block to row block
    wq, scale = formats.quantize_fp8_block(w, block)
    wq, scale = wq.to(DEV), scale.to(DEV)
    x = torch.randn(1, k, generator=g).to(DEV, torch.bfloat16)
    got = gemv.gate_up_silu(x, wq, scale, block)
    unfused = fused.silu_and_mul(gemv.gemv(x, "fp8", wq, scale, None, n, block))
    assert got.shape == (1, n // 2)
    assert torch.equal(got, unfused)
    ref64 = x.double().cpu() @ formats.dequantize_fp8_block(wq.cpu(), scale.cpu(), block).double().T
    gate, up = ref64[:, :n // 2], ref64[:, n // 2:]
    ref = torch.nn.functional.silu(gate) * up
    assert (got.double().cpu() - ref).abs().max() <= ref.abs().max() * 2 ** -6


@pytest.mark.gpu
def test_fp8_gate_up_silu_needs_its_scales(kernels):
    gemv, _ = kernels
    w = torch.zeros(16, 256, device=DEV).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="block scales"):
        gemv.gate_up_silu(torch.zeros(1, 256, dtype=torch.bfloat16, device=DEV), w)


@pytest.mark.gpu
def test_gate_up_silu_takes_at_most_two_rows(kernels):
    gemv, _ = kernels
    w = torch.zeros(16, 256, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="one row"):
        gemv.gate_up_silu(torch.zeros(3, 256, dtype=torch.bfloat16, device=DEV), w)
    wq, scale = w.to(torch.float8_e4m3fn), torch.ones(1, 2, device=DEV)
    with pytest.raises(ValueError, match="one row"):
        gemv.gate_up_silu(torch.zeros(2, 256, dtype=torch.bfloat16, device=DEV), wq, scale)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="the layer routes need a CUDA tensor (takes() reads x.is_cuda)")
def test_fp8_gate_up_layer_routes_one_row_to_the_fused_silu(kernels, monkeypatch):
    # with the switch on (NINFER_GEMV_FP8_SILU=1), an FP8 gate/up layer's one decode row takes the fused
    # SwiGLU, two rows and an NVFP4 layer do not; the fused row equals the layer's unfused forward (quant_linear,
    # then silu_and_mul) bit for bit; with it off (the default) the layer keeps the two kernels
    gemv, fused = kernels
    monkeypatch.setattr(gemv, "FP8_SILU", True)
    from engine.layers.linear import MergedColumnParallelLinear
    from engine.quant import formats
    k, f = 1024, 768
    layer = MergedColumnParallelLinear(k, [f, f], quant="fp8").to(DEV)
    g = torch.Generator().manual_seed(7)
    wq, scale = formats.quantize_fp8_block(torch.randn(2 * f, k, generator=g) * k ** -0.5)
    layer.weight.data.copy_(wq.to(DEV))
    layer.weight_scale_inv.data.copy_(scale.to(DEV))
    x = torch.randn(1, k, generator=g).to(DEV, torch.bfloat16)
    assert gemv.takes_gate_up_silu(x, layer)
    assert not gemv.takes_gate_up_silu(x.expand(2, k).contiguous(), layer)
    assert torch.equal(gemv.layer_gate_up_silu(x, layer), fused.silu_and_mul(layer(x)))
    assert not gemv.takes_gate_up_silu(x, MergedColumnParallelLinear(k, [f, f], quant="nvfp4").to(DEV))
    monkeypatch.setattr(gemv, "FP8_SILU", False)
    assert not gemv.takes_gate_up_silu(x, layer)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="the layer routes need a CUDA tensor (takes() reads x.is_cuda)")
def test_two_bf16_rows_take_the_fused_silu(kernels, monkeypatch):
    # SILU_ROWS 2 (the default): an unquantized gate/up layer's two decode rows take the fused SwiGLU and equal the
    # unfused forward bit for bit; NINFER_GEMV_SILU_ROWS=1: two rows keep the GEMV and silu_and_mul, one row is fused
    gemv, fused = kernels
    from engine.layers.linear import MergedColumnParallelLinear
    k, f = 1024, 768
    layer = MergedColumnParallelLinear(k, [f, f]).to(DEV, torch.bfloat16)
    g = torch.Generator().manual_seed(8)
    layer.weight.data.copy_((torch.randn(2 * f, k, generator=g) * k ** -0.5).to(DEV, torch.bfloat16))
    x = torch.randn(2, k, generator=g).to(DEV, torch.bfloat16)
    if "NINFER_GEMV_SILU_ROWS" not in os.environ:
        assert gemv.SILU_ROWS == 2
    monkeypatch.setattr(gemv, "SILU_ROWS", 1)
    assert gemv.takes_gate_up_silu(x[:1], layer) and not gemv.takes_gate_up_silu(x, layer)
    monkeypatch.setattr(gemv, "SILU_ROWS", 2)
    assert gemv.takes_gate_up_silu(x, layer)
    assert not gemv.takes_gate_up_silu(torch.cat([x, x[:1]]), layer)
    assert torch.equal(gemv.layer_gate_up_silu(x, layer), fused.silu_and_mul(layer(x)))
