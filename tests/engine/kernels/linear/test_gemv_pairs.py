"""The bf16 GEMV read as 32-bit words of two values (GemvConfig.pairs): each half becomes an fp32 by a shift
or a mask, where Triton's bf16 -> fp32 took ~1.7 instructions a value. Checked against x @ W^T in float64
and against the plain bf16 route, for decode and verify rows, ragged K and N and split-K; the route is taken
only where x and W can be read as aligned bf16 words."""

from __future__ import annotations

import pytest
import torch
from tests.support.kernel_backend import CUDA, DEV, needs_a_backend  # noqa: F401 (sets TRITON_INTERPRET first)

pytestmark = needs_a_backend
TOL = 0.01                              # max |error| over max |reference|: bf16 output rounding is ~0.004


@pytest.fixture(scope="module")
def kernels():
    from tests.support import kernel_checks
    if not CUDA:
        kernel_checks.patch_interpreter()
    from engine.kernels.linear import gemv
    return gemv


def _case(M, N, K, seed):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=gen) * K ** -0.5).to(DEV, torch.bfloat16)
    x = torch.randn(M, K, generator=gen).to(DEV, torch.bfloat16)
    return x, w


def _rel_err(y, x, w):
    ref = x.double() @ w.double().T
    return float((y.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("M,N,K,shape", [
    (1, 16, 1024, (2, 1024)), (2, 16, 2048, (4, 512)), (3, 10, 1000, (2, 2048)), (4, 12, 768, (4, 256)),
    (8, 24, 512, (8, 256)), (5, 13, 1536, (4, 1024)),
])                                                          # N: a few programs each (the interpreter pays per program)
def test_pairs_route_matches_the_reference_and_the_plain_route(kernels, M, N, K, shape):
    from engine.kernels.linear.gemv_triton import BF16_PAIRS_CODE
    x, w = _case(M, N, K, seed=M * 7 + N)
    cfg = kernels.GemvConfig(*shape, pairs=True)
    assert kernels.kernel_code("bf16", cfg, x, w) == BF16_PAIRS_CODE
    y = kernels.gemv(x, "bf16", w, config=cfg)
    plain = kernels.gemv(x, "bf16", w, config=kernels.GemvConfig(*shape))
    assert _rel_err(y, x, w) < TOL
    # the same products summed in another order: equal up to a bf16 rounding step of the output
    assert (y.float() - plain.float()).abs().max() <= 2 * plain.float().abs().max() * 2 ** -8


@pytest.mark.parametrize("variant", ["split2", "split3"])
def test_pairs_route_with_split_k(kernels, variant):
    cfg = {"split2": kernels.GemvConfig(4, 256, split=2, pairs=True),
           "split3": kernels.GemvConfig(2, 256, split=3, pairs=True)}[variant]
    for M in (1, 2):
        x, w = _case(M, 16, 1280, seed=M)
        for _ in range(2):                                  # the split counters must be re-armed
            assert _rel_err(kernels.gemv(x, "bf16", w, config=cfg), x, w) < TOL


def test_unaligned_activations_take_the_plain_route(kernels):
    from engine.kernels.linear.gemv_triton import BF16_CODE
    x_full, w = _case(1, 40, 513, seed=3)
    x = x_full[:, 1:]                                       # 2-byte offset: not readable as aligned words
    w = w[:, 1:].contiguous()
    cfg = kernels.GemvConfig(2, 256, pairs=True)
    assert kernels.kernel_code("bf16", cfg, x, w) == BF16_CODE
    assert _rel_err(kernels.gemv(x, "bf16", w, config=cfg), x, w) < TOL
    x_rows, w2 = _case(2, 40, 512, seed=4)
    odd_stride = torch.empty(2, 513, device=DEV, dtype=torch.bfloat16)[:, :512]
    odd_stride.copy_(x_rows)
    assert kernels.kernel_code("bf16", cfg, odd_stride, w2) == BF16_CODE
    assert _rel_err(kernels.gemv(odd_stride, "bf16", w2, config=cfg), odd_stride, w2) < TOL


def test_fp16_takes_the_plain_route(kernels):
    """The shift and mask make bf16 values; fp16 activations or weights keep the plain conversion, and so do FP8
    weights (their pair code lost served and is gone)."""
    from engine.kernels.linear.gemv_triton import BF16_CODE, FP8_CODE
    from tests.support import quant_kernel_checks as qc
    x, w = _case(2, 48, 512, seed=9)
    cfg = kernels.GemvConfig(2, 256, pairs=True)
    x16, w16 = x.to(torch.float16), w.to(torch.float16)
    assert kernels.kernel_code("bf16", cfg, x16, w16) == BF16_CODE
    assert kernels.kernel_code("bf16", cfg, x, w16) == BF16_CODE
    assert _rel_err(kernels.gemv(x16, "bf16", w16, config=cfg), x16, w16) < TOL
    wt = qc.make_weights("fp8", 64, 512, DEV, seed=2, block=(128, 128))
    for act in (x, x16):
        assert kernels.kernel_code("fp8", kernels.GemvConfig(8, 256, pairs=True), act, wt["weight"]) == FP8_CODE
