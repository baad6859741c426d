"""The decode GEMV's launch rules (engine/kernels/linear/gemv.py), which need Triton importable but no device: the FP8
one-row tile per layer shape, and the scale blocks the FP8 path refuses. The kernel itself is checked against
the reference dequantizer in tests/engine/kernels/linear/test_quant_kernels.py."""

from __future__ import annotations

import os

import pytest
import torch

G = pytest.importorskip("engine.kernels.linear.gemv", reason="the GEMV is a Triton kernel")


def _json_under(code: str, env: dict[str, str]) -> list:
    # the switches are read at import, so each setting gets its own interpreter; `code` prints one JSON line
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fp8_configs(tile: str | None, shapes) -> list:
    env = {k: v for k, v in os.environ.items() if k != "NINFER_GEMV_FP8_TILE"}
    if tile is not None:
        env["NINFER_GEMV_FP8_TILE"] = tile
    return _json_under("import json; from engine.kernels.linear import gemv as G; print(json.dumps([[c.block_n, c.block_k, "
                       "c.num_warps] for c in (G.default_config('fp8', m, n, k) for m, n, k in "
                       f"{list(shapes)!r})]))", env)


def test_fp8_one_row_tiles_by_layer_shape():
    shapes = [(1, 6144, 4096), (1, 10240, 5120), (1, 4096, 4096), (1, 24576, 4096), (1, 4096, 12288), (2, 6144, 4096)]
    # the default: 4x2048 on every one-row layer (a K that 2048 does not divide halves the tile: 32B's 5120);
    # two rows keep 8x512
    assert _fp8_configs(None, shapes) == [[4, 2048, 4], [4, 1024, 4], [4, 2048, 4], [4, 2048, 4], [4, 2048, 4],
                                          [8, 512, 4]]
    # NINFER_GEMV_FP8_TILE= (empty): the old rules, 8x1024 with 8 warps on the q/k/v shapes
    assert _fp8_configs("", shapes) == [[8, 1024, 8], [8, 1024, 8], [8, 1024, 4], [8, 1024, 4], [8, 1024, 4],
                                        [8, 512, 4]]


def test_fp8_scale_blocks_must_span_16_columns():
    # the scale multiplies sums of 16 products, so a block narrower than 16 columns is refused by name
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    w = torch.zeros(32, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiple of 16 columns, got 8"):
        G.gemv(x, "fp8", w, torch.ones(1, 8), None, 32, (32, 8))


def _rules_under(env: dict[str, str], base: dict[str, str] | None = None) -> list:
    code = ("import json; from engine.kernels.linear import gemv as G; "
            "print(json.dumps([G.GEMV_ROWS['bf16'], sorted(G.PAIRS_FORMATS)] + "
            "[G.default_config(f, m, 4096, 4096).pairs for f, m in (('bf16', 1), ('bf16', 2), ('fp8', 1), ('nvfp4', 1))]"
            " + [G.default_config('bf16', 2, 4096, 4096).block_n]))")
    return _json_under(code, {**(os.environ if base is None else base), **env})


def test_pairs_and_bf16_rows_switches():
    # the defaults: bf16 word pairs at one row and at the two verify rows (4x1024 tiles); FP8 keeps its plain codes
    env = {k: v for k, v in os.environ.items() if k not in ("NINFER_GEMV_PAIRS", "NINFER_GEMV_BF16_ROWS")}
    assert _rules_under({}, base=env) == [2, ["bf16"], True, True, False, False, 4]
    # switched off: the plain codes and the one-row bf16 GEMV
    assert _rules_under({"NINFER_GEMV_PAIRS": "", "NINFER_GEMV_BF16_ROWS": "1"}) == [1, [], False, False, False,
                                                                                     False, 8]
    # the A/B settings: each format named takes pairs (NVFP4 has no pairs code); bf16 verify rows take 4x1024 pairs
    assert _rules_under({"NINFER_GEMV_PAIRS": "bf16,fp8", "NINFER_GEMV_BF16_ROWS": "4"}) == [
        4, ["bf16", "fp8"], True, True, True, False, 4]
    assert _rules_under({"NINFER_GEMV_PAIRS": "fp8"})[2:6] == [False, False, True, False]


def test_fp8_one_row_tile_switch():
    # NINFER_GEMV_FP8_TILE replaces the one-row FP8 tile of every layer (warps 4 unless named); more rows keep theirs
    assert G._row_tile("") is None
    assert G._row_tile("4x1024") == (4, 1024, 4) and G._row_tile("2X2048x8") == (2, 2048, 8)
    for bad in ("4", "4x1000", "0x1024", "4x1024x3", "ax1024"):
        with pytest.raises(ValueError, match="NINFER_GEMV_FP8_TILE"):
            G._row_tile(bad)
    assert _fp8_configs("2x4096x8", [(1, 6144, 4096), (2, 6144, 4096)]) == [[2, 4096, 8], [8, 512, 4]]


def test_two_row_tile_and_preload_rows_switches():
    # defaults: two bf16 rows take 4x1024 pairs without the preload, one row preloads; the A/B settings of s25 d
    # (4x512 tiles, the preload at two rows) reach default_config, and a bad tile names its variable
    code = ("import json; from engine.kernels.linear import gemv as G; print(json.dumps([[c.block_n, c.block_k, c.preload] "
            "for c in (G.default_config('bf16', m, 12288, 4096) for m in (1, 2))]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NINFER_GEMV_")}
    assert _json_under(code, env) == [[2, 1024, True], [4, 1024, False]]
    assert _json_under(code, {**env, "NINFER_GEMV_BF16_TWO_ROW_TILE": "4x512", "NINFER_GEMV_PRELOAD_ROWS": "2"}) == [
        [2, 1024, True], [4, 512, True]]
    with pytest.raises(ValueError, match="NINFER_GEMV_BF16_TWO_ROW_TILE"):
        G._row_tile("4x1000", "NINFER_GEMV_BF16_TWO_ROW_TILE")
