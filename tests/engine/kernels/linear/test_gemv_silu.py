"""SwiGLU folded into the gate/up GEMV (engine.kernels.linear.gemv.gate_up_silu): one or two decode rows of bf16
weights against the unfused kernels it replaces (the GEMV, then silu_and_mul), and against float64 math. On a CUDA
device (marked gpu), or under Triton's interpreter on the CPU when NINFER_TRITON_INTERPRET_TESTS=1."""

from __future__ import annotations

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


def test_gate_up_silu_takes_at_most_two_rows(kernels):
    gemv, _ = kernels
    w = torch.zeros(16, 256, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="one or two rows"):
        gemv.gate_up_silu(torch.zeros(3, 256, dtype=torch.bfloat16, device=DEV), w)
    with pytest.raises(ValueError, match="bf16/fp16 weight rows, got 1 and 16 of torch.float8_e4m3fn"):
        gemv.gate_up_silu(torch.zeros(1, 256, dtype=torch.bfloat16, device=DEV), w.to(torch.float8_e4m3fn))


@pytest.mark.skipif(not CUDA, reason="the layer routes need a CUDA tensor (takes() reads x.is_cuda)")
def test_quantized_gate_up_layers_keep_their_own_silu(kernels):
    # an FP8 or NVFP4 gate/up layer's decode rows keep the projection then silu_and_mul: the FP8 fold lost served
    gemv, _ = kernels
    from engine.layers.linear import MergedColumnParallelLinear
    k, f = 1024, 768
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(7)).to(DEV, torch.bfloat16)
    for quant in ("fp8", "nvfp4"):
        assert not gemv.takes_gate_up_silu(x, MergedColumnParallelLinear(k, [f, f], quant=quant).to(DEV))


@pytest.mark.skipif(not CUDA, reason="the layer routes need a CUDA tensor (takes() reads x.is_cuda)")
def test_two_bf16_rows_take_the_fused_silu(kernels, monkeypatch):
    # SILU_ROWS 2: an unquantized gate/up layer's two decode rows take the fused SwiGLU and equal the unfused
    # forward bit for bit; at SILU_ROWS 1 two rows keep the GEMV and silu_and_mul, one row is fused
    gemv, fused = kernels
    from engine.layers.linear import MergedColumnParallelLinear
    k, f = 1024, 768
    layer = MergedColumnParallelLinear(k, [f, f]).to(DEV, torch.bfloat16)
    g = torch.Generator().manual_seed(8)
    layer.weight.data.copy_((torch.randn(2 * f, k, generator=g) * k ** -0.5).to(DEV, torch.bfloat16))
    x = torch.randn(2, k, generator=g).to(DEV, torch.bfloat16)
    assert gemv.SILU_ROWS == 2
    monkeypatch.setattr(gemv, "SILU_ROWS", 1)
    assert gemv.takes_gate_up_silu(x[:1], layer) and not gemv.takes_gate_up_silu(x, layer)
    monkeypatch.setattr(gemv, "SILU_ROWS", 2)
    assert gemv.takes_gate_up_silu(x, layer)
    assert not gemv.takes_gate_up_silu(torch.cat([x, x[:1]]), layer)
    assert torch.equal(gemv.layer_gate_up_silu(x, layer), fused.silu_and_mul(layer(x)))
