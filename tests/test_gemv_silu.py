"""SwiGLU folded into the gate/up GEMV (engine.kernels.gemv.gate_up_silu): one decode row against the unfused
kernels it replaces (the GEMV, then silu_and_mul), and against float64 math. On a CUDA device (marked gpu), or
under Triton's interpreter on the CPU when NINFER_TRITON_INTERPRET_TESTS=1."""

from __future__ import annotations

import pytest
import torch

from kernel_backend import CUDA, DEV, INTERPRET, needs_a_backend  # noqa: F401 (sets TRITON_INTERPRET first)

pytestmark = needs_a_backend


@pytest.fixture(scope="module")
def kernels():
    from tools import kernel_checks
    if not CUDA:
        kernel_checks.patch_interpreter()
    from engine.kernels import fused, gemv
    return gemv, fused


SHAPES = [(24576, 4096), (6144, 1024), (12290, 512)] if CUDA else [(64, 512), (36, 256), (10, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_gate_up_silu_equals_the_unfused_kernels(kernels, n, k):
    gemv, fused = kernels
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(DEV, torch.bfloat16)
    x = torch.randn(1, k, generator=g).to(DEV, torch.bfloat16)
    got = gemv.gate_up_silu(x, w)
    unfused = fused.silu_and_mul(gemv.gemv(x, "bf16", w))
    assert got.shape == (1, n // 2)
    # the same launch shape, so each row's sum runs in the same order; the same roundings after it: equal
    assert torch.equal(got, unfused)
    ref64 = x.double() @ w.double().T
    gate, up = ref64[:, :n // 2], ref64[:, n // 2:]
    ref = torch.nn.functional.silu(gate) * up
    assert (got.double() - ref).abs().max() <= ref.abs().max() * 2 ** -6


@pytest.mark.gpu
def test_gate_up_silu_takes_one_row_only(kernels):
    gemv, _ = kernels
    w = torch.zeros(16, 256, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="one row"):
        gemv.gate_up_silu(torch.zeros(2, 256, dtype=torch.bfloat16, device=DEV), w)
