"""The decode GEMV's launch rules (engine/kernels/linear/gemv.py), which need Triton importable but no device: the
launch tile per format, row count and layer shape, the scale blocks the FP8 path refuses, and what the kill switches
NINFER_GEMV_PAIRS and NINFER_GEMV_PRELOAD restore. The kernel itself is checked against the reference dequantizer
in tests/engine/kernels/linear/test_quant_kernels.py."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

G = pytest.importorskip("engine.kernels.linear.gemv", reason="the GEMV is a Triton kernel")

# The switches are read at import: one child interpreter reloads the module under each setting and prints, per
# setting, the default launch configs of bf16 / FP8 / NVFP4 at one and two rows, or the error that stopped the import
SETTINGS = [{}, {"NINFER_GEMV_PAIRS": "0"}, {"NINFER_GEMV_PRELOAD": "0"}, {"NINFER_GEMV_PAIRS": "bf16"}]
RULES = """
import importlib, json, os, sys
from engine.kernels.linear import gemv as G
out = []
for setting in json.loads(sys.argv[1]):
    for k in [k for k in os.environ if k.startswith("NINFER_GEMV_")]:
        del os.environ[k]
    os.environ.update(setting)
    try:
        importlib.reload(G)
    except ValueError as e:
        out.append(str(e))
        continue
    out.append([[c.block_n, c.block_k, c.num_warps, c.pairs, c.preload] for c in (G.default_config(f, m, 12288, 4096)
                for f, m in (("bf16", 1), ("bf16", 2), ("fp8", 1), ("fp8", 2), ("nvfp4", 1), ("nvfp4", 2)))])
print(json.dumps(out))
"""


@functools.lru_cache(maxsize=1)
def _rules() -> list:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NINFER_GEMV_")}
    out = subprocess.run([sys.executable, "-c", RULES, json.dumps(SETTINGS)], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_default_tiles_by_format_and_rows():
    # bf16: one row 2x1024 word pairs with the preload, two rows 4x1024 pairs; FP8 4x2048 at one row, 8x512 at two;
    # NVFP4 16x1024 on wide layers at one row, 8x1024 at two; the quantized formats take their plain codes
    assert _rules()[0] == [[2, 1024, 4, True, True], [4, 1024, 4, True, False], [4, 2048, 4, False, False],
                           [8, 512, 4, False, False], [16, 1024, 4, False, False], [8, 1024, 4, False, False]]
    assert G.GEMV_ROWS == {"fp8": 2, "nvfp4": 2, "bf16": 2}


def test_kill_switches_restore_the_plain_code_and_loop():
    # NINFER_GEMV_PAIRS=0: the plain bf16 code (two rows on 8x256 tiles) and so no preload; NINFER_GEMV_PRELOAD=0:
    # the word pairs without the preload. The quantized formats do not move.
    default, no_pairs, no_preload = _rules()[:3]
    assert no_pairs[:2] == [[2, 1024, 4, False, False], [8, 256, 4, False, False]] and no_pairs[2:] == default[2:]
    assert no_preload[:2] == [[2, 1024, 4, True, False], [4, 1024, 4, True, False]] and no_preload[2:] == default[2:]


def test_a_malformed_switch_stops_the_import():
    # the old format list of NINFER_GEMV_PAIRS ("bf16") is refused by name, not read as "on"
    assert _rules()[3] == "NINFER_GEMV_PAIRS='bf16': takes 1 or 0"


def test_fp8_one_row_tiles_by_layer_shape():
    shapes = [(1, 6144, 4096), (1, 10240, 5120), (1, 4096, 4096), (1, 24576, 4096), (1, 4096, 12288), (2, 6144, 4096)]
    # 4x2048 on every one-row layer (a K that 2048 does not divide halves the tile: 32B's 5120); two rows keep 8x512
    assert [[c.block_n, c.block_k, c.num_warps] for c in (G.default_config("fp8", m, n, k) for m, n, k in shapes)] == [
        [4, 2048, 4], [4, 1024, 4], [4, 2048, 4], [4, 2048, 4], [4, 2048, 4], [8, 512, 4]]


def test_fp8_scale_blocks_must_span_16_columns():
    # the scale multiplies sums of 16 products, so a block narrower than 16 columns is refused by name
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    w = torch.zeros(32, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiple of 16 columns, got 8"):
        G.gemv(x, "fp8", w, torch.ones(1, 8), None, 32, (32, 8))


def test_the_swiglu_epilogue_takes_bf16_weights_only():
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    w = torch.zeros(32, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="SwiGLU epilogue takes one or two rows of a bf16/fp16 weight, got 1 of fp8"):
        G.gemv(x, "fp8", w, torch.ones(1, 1), None, 32, silu=True)
