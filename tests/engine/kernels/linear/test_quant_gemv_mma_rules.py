"""Which quantized decode rows the tensor-core GEMV (engine/kernels/linear/quant_gemv_mma.py) takes: its shape rules
and routing, which run anywhere; the kernel itself is checked on a GPU (tests/engine/kernels/linear/test_quant_gemv_mma.py)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.linear import quant_gemv_mma as mma


def test_shape_rules():
    assert mma.supports("nvfp4", 1, 6144, 4096) and mma.supports("fp8", 8, 6144, 4096)
    assert not mma.supports("nvfp4", 1, 4096, 4160)                   # K not whole 128-column chunks
    assert mma.supports("fp8", 1, 4096, 4160)                         # FP8 chunks are 64 columns
    assert not mma.supports("fp8", 1, 4096, 4128)
    assert not mma.supports("nvfp4", 9, 4096, 4096)                   # more rows than the mma has columns
    assert not mma.supports("fp8", 1, 4100, 4096)                     # N not whole 16-row blocks
    assert not mma.supports("fp8", 1, 4096, 4096, (128, 96))          # a scale block that splits a chunk
    assert not mma.supports("fp8", 1, 4096, 4096, (8, 128))           # a scale block inside a 16-row block
    assert mma.supports("fp8", 1, 4096, 4096, (64, 64))               # a TP rank's slice of 128 blocks


def test_staged_activations_must_fit_shared_memory():
    # x is staged as fp16, M * K * 2 bytes per CTA: 8 rows of qwen3-8b's down projection fit, 8 of qwen3-32b's do not
    assert mma.supports("nvfp4", 8, 4096, 12288)
    assert mma.supports("nvfp4", 2, 5120, 25600)
    assert not mma.supports("nvfp4", 8, 5120, 25600)
    assert not mma.supports("fp8", 5, 5120, 25600)


def test_cpu_tensors_never_take_it():
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    assert not mma.takes("nvfp4", x, 4096)


def test_routing_keeps_one_fp8_row_on_the_triton_gemv():
    pytest.importorskip("triton", reason="quant_gemm is a Triton module (CUDA installs carry Triton)")
    from engine.kernels.linear.quant_gemv_mma import MMA_GEMV_ROWS
    assert 1 in MMA_GEMV_ROWS["nvfp4"] and 8 in MMA_GEMV_ROWS["nvfp4"] and 9 not in MMA_GEMV_ROWS["nvfp4"]
    assert 1 not in MMA_GEMV_ROWS["fp8"] and 2 in MMA_GEMV_ROWS["fp8"]


def test_chunk_order_is_contiguous_for_both_formats_unless_switched_off():
    # read at import (one child interpreter reloads the module under each setting): NINFER_QUANT_MMA_CONTIG=0 restores
    # chunks interleaved across the warps, for both formats
    import json
    import os
    import subprocess
    import sys
    code = ("import importlib, json, os, sys\nfrom engine.kernels.linear import quant_gemv_mma as m\nout = []\n"
            "for v in json.loads(sys.argv[1]):\n    os.environ.pop('NINFER_QUANT_MMA_CONTIG', None)\n"
            "    os.environ.update({'NINFER_QUANT_MMA_CONTIG': v} if v else {})\n"
            "    out.append(sorted(importlib.reload(m).CONTIG_FORMATS))\nprint(json.dumps(out))")
    env = {k: v for k, v in os.environ.items() if k != "NINFER_QUANT_MMA_CONTIG"}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(["", "0", "1"])], env=env, capture_output=True,
                         text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [["fp8", "nvfp4"], [], ["fp8", "nvfp4"]]
