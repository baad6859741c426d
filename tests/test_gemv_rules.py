"""The decode GEMV's launch rules (engine/kernels/gemv.py), which need Triton importable but no device: the FP8
one-row tile per layer shape, and the scale blocks the FP8 path refuses. The kernel itself is checked against
the reference dequantizer in tests/test_quant_kernels.py."""

from __future__ import annotations

import pytest
import torch

G = pytest.importorskip("engine.kernels.gemv", reason="the GEMV is a Triton kernel")


def test_fp8_one_row_tiles_by_layer_shape():
    # q/k/v-shaped layers (qwen3-8b 6144 x 4096, qwen3-32b 10240 x 5120) take 8 warps; o, gate_up, down take 4
    assert G.default_config("fp8", 1, 6144, 4096).num_warps == 8
    assert G.default_config("fp8", 1, 10240, 5120).num_warps == 8
    for n, k in ((4096, 4096), (24576, 4096), (4096, 12288), (3072, 4096)):
        cfg = G.default_config("fp8", 1, n, k)
        assert (cfg.block_n, cfg.block_k, cfg.num_warps) == (8, 1024, 4), (n, k)
    assert G.default_config("fp8", 2, 6144, 4096).num_warps == 4


def test_fp8_scale_blocks_must_span_16_columns():
    # the scale multiplies sums of 16 products, so a block narrower than 16 columns is refused by name
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    w = torch.zeros(32, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiple of 16 columns, got 8"):
        G.gemv(x, "fp8", w, torch.ones(1, 8), None, 32, (32, 8))
