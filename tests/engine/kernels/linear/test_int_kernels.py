"""The integer weight-only kernels (engine/kernels/linear/int_gemm.py) and the FP8 per-channel path
(fp8_channel.py) against the reference dequantizer (engine.quant.int_formats): on a CUDA device at qwen3-8b
shapes, or at tiny shapes under Triton's interpreter on the CPU (NINFER_TRITON_INTERPRET_TESTS=1). The bound is
bf16 output rounding (2^-8 of the largest output)."""

from __future__ import annotations

import pytest
import torch

from tests.support.kernel_backend import CUDA, DEV, needs_a_backend  # noqa: F401 (sets TRITON_INTERPRET first)

pytestmark = needs_a_backend
TOL = 2 ** -8

# (M, N, K): decode rows (the FMA GEMV up to 4, tensor cores above) and prefill
SHAPES = ([(1, 6144, 4096), (4, 4096, 4096), (8, 24576, 4096), (300, 4096, 12288)] if CUDA else
          [(1, 48, 256), (3, 40, 128), (20, 64, 256)])
# (bits, group_size, symmetric, act order): GPTQ/AWQ/compressed-tensors' usual schemes, per-channel, act order
SCHEMES = [(4, 128, True, False), (4, 64, False, False), (8, 128, False, False), (8, 0, True, False),
           (4, 32, False, True), (8, 64, True, True)]


@pytest.fixture(scope="module")
def interp():
    from tests.support import kernel_checks
    if not CUDA:
        kernel_checks.patch_interpreter()


def _weights(N: int, K: int, bits: int, gs: int, sym: bool, act: bool, seed: int) -> dict:
    from engine.quant import int_formats as I
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * K ** -0.5
    q = I.quantize_int(w, bits, gs, sym)
    g = None
    if act:        # a GPTQ act-order assignment: each group keeps its size, its columns anywhere in K
        g = (torch.randperm(K, generator=gen) // gs).int()
        q["ref"] = I.dequantize_int(q["qweight"], q["scales"], q["zeros"], bits, gs, g)
    return {k: v.to(DEV) for k, v in q.items()} | {"g_idx": None if g is None else g.to(DEV)}


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES, ids=[f"w{b}g{g}{'s' if s else 'a'}{'-act' if a else ''}" for b, g, s, a in SCHEMES])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_int_matmul_matches_the_reference(interp, scheme, shape):
    from engine.kernels.linear.int_gemm import int_matmul
    (M, N, K), (bits, gs, sym, act) = shape, scheme
    q = _weights(N, K, bits, gs, sym, act, seed=M + N + bits)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(device=DEV, dtype=torch.bfloat16)
    y = int_matmul(x, q["qweight"], q["scales"], q["zeros"], bits, gs, q["g_idx"])
    ref = x.float() @ q["ref"].T
    assert not torch.isnan(y).any()
    assert float((y.float() - ref).abs().max() / ref.abs().max()) < TOL


@pytest.mark.gpu
def test_launch_shapes_that_split_k_inside_a_group(interp):
    """Tiles of 32 columns inside groups of 128, and one program for several row blocks."""
    from engine.kernels.linear.int_gemm import int_matmul
    q = _weights(40, 256, 4, 128, False, False, seed=3)
    for M, block in ((2, (2, 16, 32)), (9, (16, 32, 32))):
        x = torch.randn(M, 256, generator=torch.Generator().manual_seed(M)).to(device=DEV, dtype=torch.bfloat16)
        y = int_matmul(x, q["qweight"], q["scales"], q["zeros"], 4, 128, block=block)
        ref = x.float() @ q["ref"].T
        assert float((y.float() - ref).abs().max() / ref.abs().max()) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + ([(70, 32, 96)] if not CUDA else []), ids=lambda s: "x".join(map(str, s)))
def test_fp8_per_channel_matches_the_reference(interp, shape):
    from engine.kernels.linear.fp8_channel import fp8_channel_matmul
    M, N, K = shape
    gen = torch.Generator().manual_seed(N)
    w = torch.randn(N, K, generator=gen) * K ** -0.5
    scale = w.abs().amax(1) / 448.0
    q = (w / scale[:, None]).to(torch.float8_e4m3fn)
    x = torch.randn(M, K, generator=gen).to(device=DEV, dtype=torch.bfloat16)
    y = fp8_channel_matmul(x, q.to(DEV), scale.to(DEV))
    ref = x.float() @ (q.float() * scale[:, None]).to(DEV).T
    tol = TOL if M <= 64 or not CUDA else 2 * TOL       # row-wise FP8 prefill quantizes the activations too
    assert float((y.float() - ref).abs().max() / ref.abs().max()) < tol


@pytest.mark.gpu
def test_a_quantized_layer_takes_the_kernel(interp):
    """The int layer's forward on bf16 activations (engine.quant.linear.apply -> int_gemm) equals its reference."""
    from engine.kernels.linear.int_gemm import int_linear
    from engine.layers.linear import RowParallelLinear
    from engine.quant.layouts import LinearQuant
    q = _weights(64, 256, 8, 64, False, True, seed=5)
    layer = RowParallelLinear(256, 64, quant=LinearQuant("int", 8, 64, True, "test.o_proj"))
    for name in ("qweight", "scales", "zeros", "g_idx"):
        getattr(layer, name).data = q[name].cpu().to(getattr(layer, name).dtype)
    layer.to(DEV)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)).to(device=DEV, dtype=torch.bfloat16)
    from engine.quant.linear import dequantized_weight
    ref = x.float() @ dequantized_weight(layer).T
    y = int_linear(layer, x)
    assert float((y.float() - ref).abs().max() / ref.abs().max()) < TOL
