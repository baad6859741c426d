"""The GEMV's preload (GemvConfig.preload): the first weight tile read before the PDL wait and each next one at
the end of the iteration before. Only where the loads are issued moves, so the output must be bit-equal to the
plain loop's for every row count, ragged shape, split-K and the SwiGLU epilogue; the codes that do not take it (the
plain bf16, FP8 and NVFP4 codes) must be unchanged too. On a CUDA device (marked gpu), or under Triton's interpreter
on the CPU when NINFER_TRITON_INTERPRET_TESTS=1."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.support.kernel_backend import CUDA, DEV, needs_a_backend  # noqa: F401 (sets TRITON_INTERPRET first)

pytestmark = needs_a_backend


@pytest.fixture(scope="module")
def gemv():
    from tests.support import kernel_checks
    if not CUDA:
        kernel_checks.patch_interpreter()
    from engine.kernels.linear import gemv
    return gemv


def _weights(fmt: str, n: int, k: int, seed: int) -> dict:
    from tests.support.quant_kernel_checks import make_weights
    if fmt == "bf16":
        w = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k ** -0.5).to(DEV, torch.bfloat16)
        return {"weight": w, "scale": None, "row_scale": None, "block": (128, 128)}
    return make_weights(fmt, n, k, DEV, seed, (64, 32) if fmt == "fp8" else (128, 128))


class _LaunchRecorder:
    """Stands in for gemv_kernel in engine.kernels.linear.gemv: launches the real kernel and keeps each launch's
    keyword arguments, so a test can say which path ran (PRELOAD, SILU, FMT)."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.calls.append(kwargs)
            return launch(*args, **kwargs)
        return run


@pytest.fixture
def launches(gemv, monkeypatch):
    recorder = _LaunchRecorder(gemv.gemv_kernel)
    monkeypatch.setattr(gemv, "gemv_kernel", recorder)
    return recorder.calls


# (format, config, rows, N, K, takes it): whole tiles (the unmasked loads, whose last preload re-reads the last tile),
# ragged N and K (masked: the load past the end reads nothing), a split of K, on the bf16 word-pair code that takes
# the preload; the plain bf16, FP8 and NVFP4 codes ignore it (their tiles would be carried as bytes). N is a few
# programs' worth: every program runs the same loop, and Triton's interpreter pays for each one
CASES = [
    ("bf16", dict(block_n=2, block_k=256, pairs=True), 1, 16, 1024, True),
    ("bf16", dict(block_n=4, block_k=256, pairs=True), 1, 18, 1024, True),          # ragged N
    ("bf16", dict(block_n=4, block_k=256, pairs=True), 2, 20, 520, True),          # ragged K
    ("bf16", dict(block_n=2, block_k=256, split=2, pairs=True), 1, 16, 2048, True),
    ("bf16", dict(block_n=2, block_k=256), 1, 16, 1024, False),
    ("fp8", dict(block_n=4, block_k=256, pairs=True), 1, 32, 1024, False),
    ("fp8", dict(block_n=4, block_k=256), 1, 20, 1024, False),
    ("nvfp4", dict(block_n=8, block_k=256), 2, 40, 1008, False),
]


@pytest.mark.parametrize("fmt,cfg,rows,n,k,takes", CASES,
                         ids=[f"{f}-{r}x{n}x{k}-{'-'.join(map(str, c.values()))}" for f, c, r, n, k, _ in CASES])
def test_preload_is_bit_equal_to_the_plain_loop(gemv, launches, fmt, cfg, rows, n, k, takes):
    wt = _weights(fmt, n, k, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEV, torch.bfloat16)
    plain_cfg = gemv.GemvConfig(**cfg)
    outs = []
    for c in (plain_cfg, replace(plain_cfg, preload=True), replace(plain_cfg, preload=True)):   # twice: split counters
        outs.append(gemv.gemv(x, fmt, wt["weight"], wt["scale"], wt["row_scale"], n, wt["block"], c))
    assert [c["PRELOAD"] for c in launches] == [False, takes, takes]
    assert outs[0].shape == (rows, n) and torch.isfinite(outs[0].float()).all()
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])


@pytest.mark.parametrize("rows", [1, 2])
def test_preload_with_the_swiglu_epilogue(gemv, launches, rows):
    n, k = 64, 1024
    wt = _weights("bf16", n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7)).to(DEV, torch.bfloat16)
    cfg = gemv.GemvConfig(4, 256, pairs=True)
    plain = gemv.gemv(x, "bf16", wt["weight"], config=cfg, silu=True)
    pre = gemv.gemv(x, "bf16", wt["weight"], config=replace(cfg, preload=True), silu=True)
    assert [(c["SILU"], c["PRELOAD"]) for c in launches] == [(True, False), (True, True)]
    assert pre.shape == (rows, n // 2) and torch.equal(pre, plain)


def test_preload_is_left_off_where_it_was_not_measured(gemv, launches):
    """fp16 activations (the plain bf16 code) and FP8's byte code keep the plain loop even when the config asks for
    the preload."""
    k = 1024
    wt = _weights("bf16", 64, k, seed=3)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3)).to(DEV, torch.bfloat16)
    cfg = gemv.GemvConfig(2, 256, pairs=True, preload=True)
    gemv.gemv(x.half(), "bf16", wt["weight"].half(), config=cfg)
    fp8 = _weights("fp8", 64, k, seed=4)
    gemv.gemv(x, "fp8", fp8["weight"], fp8["scale"], None, 64, fp8["block"], gemv.GemvConfig(4, 256, preload=True))
    assert [c["PRELOAD"] for c in launches] == [False, False]


def test_default_configs_preload_one_bf16_row(gemv, monkeypatch):
    """The default: one bf16 row preloads, two rows and the quantized formats do not; NINFER_GEMV_PRELOAD=0
    (gemv.PRELOAD False) turns it off."""
    monkeypatch.setattr(gemv, "PRELOAD", True)
    assert gemv.default_config("bf16", 1, 4096, 4096).preload
    assert not gemv.default_config("bf16", 2, 4096, 4096).preload
    assert not any(gemv.default_config(f, m, 4096, 4096).preload for f in ("fp8", "nvfp4") for m in (1, 2))
    monkeypatch.setattr(gemv, "PRELOAD", False)
    assert not gemv.default_config("bf16", 1, 4096, 4096).preload
