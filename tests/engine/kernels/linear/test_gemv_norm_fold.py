"""The RMSNorm and the residual add folded into the decode GEMV (engine/layers/norm_fold.py): `NORM` takes the
un-normed residual stream and must give what RMSNorm then the GEMV give, `RESIDUAL` must give the projection
plus the stream rounded as the unfused add rounds (bit-equal), for bf16 (word pairs and plain) and FP8 (plain
and pairs) at one and two rows, with and without the SwiGLU epilogue. On a CUDA device, or under Triton's
interpreter with NINFER_TRITON_INTERPRET_TESTS=1."""

from __future__ import annotations

import os

import pytest
import torch
from tests.support.kernel_backend import CUDA, DEV, needs_a_backend  # noqa: F401 (sets TRITON_INTERPRET first)

pytestmark = needs_a_backend
EPS = 1e-6


@pytest.fixture(scope="module")
def kernels():
    from tests.support import kernel_checks
    if not CUDA:
        kernel_checks.patch_interpreter()
    from engine.kernels.linear import gemv
    return gemv


def _norm_ref(x, w):
    # the unfused path's rounding: engine.layers.norm.RMSNorm._norm (x / rms rounded to bf16, then the weight)
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _weights(fmt, N, K, seed):
    from tests.support.quant_kernel_checks import make_weights
    if fmt == "bf16":
        gen = torch.Generator().manual_seed(seed)
        return {"weight": (torch.randn(N, K, generator=gen) * K ** -0.5).to(DEV, torch.bfloat16), "scale": None,
                "block": (128, 128)}
    return make_weights("fp8", N, K, DEV, seed)


def _dequantized(wt, fmt):
    return (wt["weight"].float() if fmt == "bf16" else wt["ref"]).double()


def _inputs(M, K, seed):
    gen = torch.Generator().manual_seed(seed)
    # a residual stream with a spread of magnitudes (rms far from 1) and a norm weight far from ones
    x = (torch.randn(M, K, generator=gen) * torch.linspace(0.2, 9.0, K)).to(DEV, torch.bfloat16)
    nw = (0.5 + torch.rand(K, generator=gen)).to(DEV, torch.bfloat16)
    return x, nw


def _close(y, ref, steps=2):
    """Equal up to `steps` bf16 rounding steps of the largest output."""
    err = float((y.float() - ref.float()).abs().max())
    return err <= steps * float(ref.float().abs().max()) * 2 ** -8, err


CASES = [("bf16", (2, 256), True), ("bf16", (4, 128), False), ("fp8", (4, 256), False), ("fp8", (4, 256), True)]


@pytest.mark.parametrize("fmt,tile,pairs", CASES, ids=[f"{f}-{t[0]}x{t[1]}-{'pairs' if p else 'plain'}"
                                                       for f, t, p in CASES])
@pytest.mark.parametrize("M", [1, 2])
def test_folded_norm_equals_the_norm_then_the_gemv(kernels, fmt, tile, pairs, M):
    N, K = 96, 512
    wt = _weights(fmt, N, K, seed=N + M)
    x, nw = _inputs(M, K, seed=M)
    cfg = kernels.GemvConfig(*tile, pairs=pairs)
    folded = kernels.gemv(x, fmt, wt["weight"], wt["scale"], None, N, wt["block"], cfg, norm_weight=nw, eps=EPS)
    unfused = kernels.gemv(_norm_ref(x, nw), fmt, wt["weight"], wt["scale"], None, N, wt["block"], cfg)
    ok, err = _close(folded, unfused)
    assert ok, f"folded norm off by {err}"
    # and the folded result is the exact math (x / rms * weight, unrounded) to bf16 output rounding
    xd = x.double()
    exact = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * nw.double()) @ _dequantized(wt, fmt).T
    ok, err = _close(folded, exact, steps=1)
    assert ok, f"folded norm off the exact math by {err}"


@pytest.mark.parametrize("fmt,tile,pairs", CASES, ids=[f"{f}-{t[0]}x{t[1]}-{'pairs' if p else 'plain'}"
                                                       for f, t, p in CASES])
@pytest.mark.parametrize("M", [1, 2])
def test_folded_residual_add_is_bit_equal_to_the_gemv_then_the_add(kernels, fmt, tile, pairs, M):
    N, K = 64, 512
    wt = _weights(fmt, N, K, seed=3 * N + M)
    x, _ = _inputs(M, K, seed=10 + M)
    res = torch.randn(M, N, generator=torch.Generator().manual_seed(7)).to(DEV, torch.bfloat16) * 4
    cfg = kernels.GemvConfig(*tile, pairs=pairs)
    folded = kernels.gemv(x, fmt, wt["weight"], wt["scale"], None, N, wt["block"], cfg, residual=res)
    y = kernels.gemv(x, fmt, wt["weight"], wt["scale"], None, N, wt["block"], cfg)
    assert torch.equal(folded, (y.float() + res.float()).to(torch.bfloat16))


@pytest.mark.parametrize("fmt,M", [("bf16", 1), ("bf16", 2), ("fp8", 1)])
def test_folded_norm_with_the_swiglu_epilogue(kernels, fmt, M):
    F_, K = 48, 512
    wt = _weights(fmt, 2 * F_, K, seed=5 + M)
    x, nw = _inputs(M, K, seed=20 + M)
    folded = kernels.gate_up_silu(x, wt["weight"], wt["scale"], wt["block"], norm_weight=nw, eps=EPS)
    unfused = kernels.gate_up_silu(_norm_ref(x, nw), wt["weight"], wt["scale"], wt["block"])
    assert folded.shape == (M, F_)
    # against the exact math: the product of two rounded projections can move by more than two steps of the
    # output, so the bound is the unfused path's own error (the fold rounds less, so it should not be worse)
    xd = x.double()
    gu = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * nw.double()) @ _dequantized(wt, fmt).T
    exact = torch.nn.functional.silu(gu[:, :F_]) * gu[:, F_:]
    err_folded = float((folded.double() - exact).abs().max())
    err_unfused = float((unfused.double() - exact).abs().max())
    assert err_folded <= max(err_unfused, 2 * float(exact.abs().max()) * 2 ** -8), (err_folded, err_unfused)


VARIANTS = [("bf16", dict(block_n=4, block_k=256, pairs=True), 100, 520),          # ragged N and K, word pairs
            ("bf16", dict(block_n=4, block_k=256, x2d=False), 96, 512),            # x loaded once, not per row
            ("bf16", dict(block_n=2, block_k=256, prefetch=True, pairs=True), 96, 1024),
            ("fp8", dict(block_n=4, block_k=256, prefetch=True), 100, 1024),       # ragged N: the plain FP8 code
            ("fp8", dict(block_n=4, block_k=256, x2d=False), 96, 512),
            ("bf16", None, 96, 1024), ("fp8", None, 128, 1024)]                     # default tiles (the register caps)


@pytest.mark.parametrize("fmt,cfg,N,K", VARIANTS, ids=[f"{f}-{c}-{n}x{k}" for f, c, n, k in VARIANTS])
@pytest.mark.parametrize("M", [1, 2])
def test_folds_on_other_tiles(kernels, fmt, cfg, N, K, M):
    wt = _weights(fmt, N, K, seed=N + K + M)
    x, nw = _inputs(M, K, seed=K + M)
    config = kernels.GemvConfig(**cfg) if cfg else None
    args = (x, fmt, wt["weight"], wt["scale"], None, N, wt["block"], config)
    folded = kernels.gemv(*args, norm_weight=nw, eps=EPS)
    xd = x.double()
    exact = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * nw.double()) @ _dequantized(wt, fmt).T
    ok, err = _close(folded, exact, steps=1)
    assert ok, f"folded norm off the exact math by {err}"
    res = torch.randn(M, N, generator=torch.Generator().manual_seed(3)).to(DEV, torch.bfloat16)
    y = kernels.gemv(*args)
    assert torch.equal(kernels.gemv(*args, residual=res), (y.float() + res.float()).to(torch.bfloat16))


def test_folds_are_refused_where_the_kernel_cannot_take_them(kernels):
    K, N = 256, 32
    wt = _weights("bf16", N, K, seed=1)
    x, nw = _inputs(3, K, seed=1)
    with pytest.raises(ValueError, match="folded norm takes 1..2 rows"):
        kernels.gemv(x, "bf16", wt["weight"], norm_weight=nw)
    with pytest.raises(ValueError, match="weight of 256 values"):
        kernels.gemv(x[:1], "bf16", wt["weight"], norm_weight=nw[:128])
    with pytest.raises(ValueError, match="contiguous torch.bfloat16 weight"):
        kernels.gemv(x[:1], "bf16", wt["weight"], norm_weight=nw.float())
    with pytest.raises(ValueError, match=r"residual must be torch.bfloat16 \[1, 32\]"):
        kernels.gemv(x[:1], "bf16", wt["weight"], residual=torch.zeros(1, 31, device=DEV, dtype=torch.bfloat16))


def test_fold_eligibility_by_format_and_rows(monkeypatch):
    from types import SimpleNamespace

    from engine.layers import norm_fold
    assert norm_fold.FOLD_ROWS == int(os.environ.get("NINFER_GEMV_NORM_FOLD", "0"))   # off unless asked (it lost)
    monkeypatch.setattr(norm_fold, "FOLD_ROWS", 2)
    bf16, fp8, nvfp4 = (SimpleNamespace(quant=None), SimpleNamespace(quant="fp8", scale_block=(128, 128)),
                        SimpleNamespace(quant="nvfp4"))
    assert norm_fold.linear_folds(bf16, 1) and norm_fold.linear_folds(bf16, 2)
    assert not norm_fold.linear_folds(bf16, 3)                     # the skinny tensor-core GEMM's rows
    assert norm_fold.linear_folds(fp8, 1) and not norm_fold.linear_folds(fp8, 2)   # FP8 verify rows: MMA GEMV
    assert not norm_fold.linear_folds(nvfp4, 1)                    # NVFP4 rows: the tensor-core GEMV
    monkeypatch.setattr(norm_fold, "FOLD_ROWS", 1)
    assert norm_fold.linear_folds(bf16, 1) and not norm_fold.linear_folds(bf16, 2)
