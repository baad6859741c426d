"""The GEMV's preload (GemvConfig.preload): the first weight tile read before the PDL wait and each next one at
the end of the iteration before. Only where the loads are issued moves, so the output must be bit-equal to the
plain loop's for every format, row count, ragged shape, split-K and the SwiGLU epilogue. On a CUDA device (marked
gpu), or under Triton's interpreter on the CPU when NINFER_TRITON_INTERPRET_TESTS=1."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernel_backend import CUDA, DEV, needs_a_backend  # noqa: F401 (sets TRITON_INTERPRET first)

pytestmark = needs_a_backend


@pytest.fixture(scope="module")
def gemv():
    from tools import kernel_checks
    if not CUDA:
        kernel_checks.patch_interpreter()
    from engine.kernels import gemv
    return gemv


def _weights(fmt: str, n: int, k: int, seed: int) -> dict:
    from tools.quant_kernel_checks import make_weights
    if fmt == "bf16":
        w = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k ** -0.5).to(DEV, torch.bfloat16)
        return {"weight": w, "scale": None, "row_scale": None, "block": (128, 128)}
    return make_weights(fmt, n, k, DEV, seed, (64, 32) if fmt == "fp8" else (128, 128))


# (format, config, rows, N, K): whole tiles (the unmasked loads, whose last preload re-reads the last tile), ragged
# N and K (masked: the load past the end reads nothing), a split of K, on the word-pair codes that take the preload;
# the plain FP8 and NVFP4 codes ignore it (their tiles would be carried as bytes) and must be unchanged too
CASES = [
    ("bf16", dict(block_n=2, block_k=256, pairs=True), 1, 96, 1024),
    ("bf16", dict(block_n=4, block_k=256, pairs=True), 2, 100, 520),
    ("bf16", dict(block_n=2, block_k=256, split=2, pairs=True), 1, 64, 2048),
    ("fp8", dict(block_n=4, block_k=256, pairs=True), 1, 128, 1024),
    ("fp8", dict(block_n=4, block_k=256, pairs=True), 2, 128, 1536),
    ("fp8", dict(block_n=4, block_k=256, split=3, pairs=True), 1, 64, 1536),
    ("fp8", dict(block_n=4, block_k=256), 1, 100, 1024),
    ("nvfp4", dict(block_n=8, block_k=256), 2, 40, 1008),
]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,cfg,rows,n,k", CASES,
                         ids=[f"{f}-{r}x{n}x{k}-{'-'.join(map(str, c.values()))}" for f, c, r, n, k in CASES])
def test_preload_is_bit_equal_to_the_plain_loop(gemv, fmt, cfg, rows, n, k):
    wt = _weights(fmt, n, k, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEV, torch.bfloat16)
    plain_cfg = gemv.GemvConfig(**cfg)
    outs = []
    for c in (plain_cfg, replace(plain_cfg, preload=True), replace(plain_cfg, preload=True)):   # twice: split counters
        outs.append(gemv.gemv(x, fmt, wt["weight"], wt["scale"], wt["row_scale"], n, wt["block"], c))
    assert outs[0].shape == (rows, n) and torch.isfinite(outs[0].float()).all()
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,rows", [("bf16", 1), ("bf16", 2), ("fp8", 1)])
def test_preload_with_the_swiglu_epilogue(gemv, fmt, rows):
    n, k = 64, 1024
    wt = _weights(fmt, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7)).to(DEV, torch.bfloat16)
    cfg = gemv.GemvConfig(4, 256, pairs=fmt == "bf16")
    plain = gemv.gemv(x, fmt, wt["weight"], wt["scale"], config=cfg, silu=True, scale_block=wt["block"])
    pre = gemv.gemv(x, fmt, wt["weight"], wt["scale"], config=replace(cfg, preload=True), silu=True,
                    scale_block=wt["block"])
    assert pre.shape == (rows, n // 2) and torch.equal(pre, plain)


def test_preload_formats_switch_the_default_configs(gemv, monkeypatch):
    monkeypatch.setattr(gemv, "PRELOAD_FORMATS", frozenset({"fp8"}))
    assert gemv.default_config("fp8", 1, 4096, 4096).preload
    assert not gemv.default_config("bf16", 1, 4096, 4096).preload
    assert not gemv.default_config("fp8", 2, 4096, 4096).preload          # one row only
    monkeypatch.setattr(gemv, "PRELOAD_FORMATS", frozenset())
    assert not gemv.default_config("fp8", 1, 4096, 4096).preload
