"""The bf16/fp16 tensor-core skinny GEMM (engine/kernels/linear/skinny_gemm.py) against torch in fp32: under Triton's
interpreter on the CPU at tiny shapes (opt-in like tests/engine/kernels/linear/test_quant_kernels.py:
NINFER_TRITON_INTERPRET_TESTS=1), or on a CUDA device at the qwen3-8b decode shapes (marked gpu). The
bound is bf16 output rounding: 2^-8 of the largest output."""

from __future__ import annotations


import pytest
import torch

from tests.support.kernel_backend import CUDA, DEV, INTERPRET, needs_a_backend  # noqa: F401 (sets TRITON_INTERPRET first)

pytestmark = needs_a_backend
TOL = 2 ** -8


@pytest.fixture(scope="module")
def Q():
    from engine.kernels.linear import skinny_gemm as skinny_dense
    if not CUDA:
        from tests.support import kernel_checks
        kernel_checks.patch_interpreter()
    return skinny_dense


def _rel_err(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> float:
    # x: [M, K]; w: [N, K]; y: [M, N] -> max error over the largest output, against fp32
    ref = x.float() @ w.float().t()
    return float((y.float() - ref).abs().max() / ref.abs().max())


def _case(M: int, N: int, K: int, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEV)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype).to(DEV)
    return x, w


@pytest.mark.skipif(CUDA, reason="interpreter-only check")
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 8])
def test_rows_and_splits_interpreted(Q, M, split):
    """N and K not multiples of the 64x64 tile; the last split shorter than the others."""
    x, w = _case(M, 100, 328, seed=M + split)
    cfg = Q.DenseConfig(64, 64, split=split)
    assert Q.dense_split(cfg, M, 100, 328, 4)[0] == split
    y = Q.skinny_dense(x, w, cfg)
    assert y.shape == (M, 100) and y.dtype == x.dtype
    assert _rel_err(x, w, y) < TOL


@pytest.mark.skipif(CUDA, reason="interpreter-only check")
def test_even_tiles_sixteen_rows_fp16_interpreted(Q):
    """The unmasked weight path (N, K multiples of the tile), 16 rows, fp16, the split chosen from the shape."""
    x, w = _case(16, 128, 512, torch.float16, seed=5)
    cfg = Q.DenseConfig(64, 64, min_k_tiles=2)
    assert Q.dense_split(cfg, 16, 128, 512, 4)[0] == 4           # 2 output blocks, 8 programs asked for
    assert _rel_err(x, w, Q.skinny_dense(x, w, cfg)) < TOL


@pytest.mark.skipif(CUDA, reason="interpreter-only check")
@pytest.mark.parametrize("split", [1, 2])
def test_tma_descriptor_path_interpreted(Q, split):
    """The weight tile by descriptor: rows past N and columns past K come back zero."""
    x, w = _case(3, 100, 328, seed=7 + split)
    assert _rel_err(x, w, Q.skinny_dense(x, w, Q.DenseConfig(64, 64, split=split, tma=True))) < TOL


def test_counters_rearmed_two_calls(Q):
    """A split call leaves its counters zero (the next launch, or a graph replay, finds them armed): two calls
    in a row give the same bits, and a different input after them is right too."""
    from engine.kernels.linear.splitk import workspace
    n, k = (1000, 4160) if CUDA else (130, 328)
    cfg = Q.DenseConfig(64, 64, split=3)
    x, w = _case(4, n, k, seed=11)
    y1 = Q.skinny_dense(x, w, cfg)
    y2 = Q.skinny_dense(x, w, cfg)
    assert torch.equal(y1, y2) and _rel_err(x, w, y1) < TOL
    cnt = workspace(x.device)[1]
    assert int(cnt[: -(-n // 64)].abs().sum()) == 0
    x3, _ = _case(2, n, k, seed=12)
    assert _rel_err(x3, w, Q.skinny_dense(x3, w, cfg)) < TOL


def test_split_from_shapes(Q):
    """Split counts depend on shapes only: rounded down, the grid stays within programs_per_sm * SMs (all
    resident at once) and one more split would pass it; rounded up (split_up) it reaches it. The partials
    fit the workspace (lm_head at 8 rows is not split) and a split keeps min_k_tiles tiles."""
    down, up = Q.DenseConfig(), Q.DenseConfig(split_up=True)
    for M, N, K in [(2, 4096, 4096), (2, 6144, 4096), (4, 4096, 12288), (8, 3072, 4096), (2, 4096, 2048)]:
        grid_n = N // 64
        split, kps = Q.dense_split(down, M, N, K, 132)
        assert grid_n * split <= 2 * 132 < grid_n * (split + 1) and kps % 128 == 0 and (split - 1) * kps < K
        split, kps = Q.dense_split(up, M, N, K, 132)
        assert (grid_n * split >= 2 * 132 or kps == 4 * 128) and (split - 1) * kps < K     # or min_k_tiles
    assert Q.dense_split(down, 8, 24576, 4096, 132)[0] == 1            # 384 output blocks already
    assert Q.dense_split(up, 8, 151936, 4096, 132)[0] == 1
    assert Q.dense_split(down, 2, 64, 256, 132)[0] == 1                # min_k_tiles keeps 2 tiles unsplit


def test_rejects_bad_calls(Q):
    x, w = _case(17, 64, 64)
    with pytest.raises(ValueError):
        Q.skinny_dense(x, w)
    with pytest.raises(ValueError):
        Q.skinny_dense(x[:2], w.to(torch.float16))


GPU_SHAPES = [(2, 6144, 4096), (2, 4096, 4096), (3, 24576, 4096), (4, 4096, 12288), (8, 3072, 4096),
              (8, 4096, 2048), (1, 151936, 4096), (5, 1000, 1000), (12, 4096, 4096), (16, 151936, 4096)]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in GPU_SHAPES])
def test_gpu_shapes(Q, shape, tma):
    M, N, K = shape
    x, w = _case(M, N, K, seed=N + K)
    for cfg in (Q.DenseConfig(tma=tma), Q.DenseConfig(128, 128, 4, 3, tma=tma), Q.DenseConfig(64, 256, 4, 3, tma=tma)):
        y = Q.skinny_dense(x, w, cfg)
        assert _rel_err(x, w, y) < TOL, (cfg, _rel_err(x, w, y))
        assert torch.equal(y, Q.skinny_dense(x, w, cfg)), cfg          # deterministic, counters re-armed


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_graph_replays(Q):
    """Captured once, replayed with new activations: the split's counters stay armed across replays."""
    x, w = _case(4, 4096, 4096, seed=3)
    Q.skinny_dense(x, w)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = Q.skinny_dense(x, w)
    for seed in range(3):
        x.copy_(_case(4, 4096, 4096, seed=seed + 20)[0])
        g.replay()
        torch.cuda.synchronize()
        assert _rel_err(x, w, y) < TOL
