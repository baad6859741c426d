"""Tuned launch values kept as data (engine/kernels/tuned.py): the values in each family's tuned/h200.json are the ones
the code held before they moved there, the tuner that writes each section (`--write`) picks the same values again
from the run the section names, and a missing or broken file gives the caller's fallback.

  engine/kernels/linear/tuned/h200.json      skinny_dense                         tools/dev/skinny_bf16_sweep.py
  engine/kernels/attention/tuned/h200.json   decode_bf16_long, decode_int8_long   tools/dev/tune_decode_attention.py
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from engine.kernels.attention import paged as A
from engine.kernels.linear import skinny_gemm as Q
from engine.kernels.tuned import load_tuned, tuned_path, write_tuned

ROOT = Path(__file__).resolve().parents[3]
LINEAR = json.loads(tuned_path(Q.__file__).read_text())
ATTENTION = json.loads(tuned_path(A.__file__).read_text())


def _values(section: dict) -> dict:
    return {k: v for k, v in section.items() if k not in ("source", "device")}


def test_the_skinny_gemm_uses_the_shapes_it_had_in_code():
    narrow = Q.DenseConfig(block_n=64, block_k=256, num_stages=3, programs_per_sm=1)
    wide = Q.DenseConfig(block_n=128, block_k=128, num_stages=3)
    assert (Q.WIDE_N, Q.NARROW_CONFIG, Q.WIDE_CONFIG) == (65536, narrow, wide)
    section = LINEAR["skinny_dense"]
    assert (section["wide_n"], section["narrow"], section["wide"]) == (65536, dataclasses.asdict(narrow),
                                                                       dataclasses.asdict(wide))
    assert Q.default_dense_config(2, 151936, 4096) == wide          # lm_head
    assert Q.default_dense_config(8, 24576, 4096) == narrow         # qwen3-8b gate_up, the widest layer


def test_the_decode_attention_uses_the_long_context_shapes_it_had_in_code():
    assert A._INT8_LONG_TUNED and A._BF16_LONG_TUNED                 # the file found: the shapes are on
    assert (A.INT8_LONG_PREFETCH, A.INT8_LONG_WARPS, A.INT8_LONG_PROGRAMS_PER_SM) == (1, 4, 2)
    assert A.BF16_LONG_SHAPE == {"prefetch": 1, "num_stages": 1, "max_regs": 128}


def test_the_tuners_pick_the_file_s_values_from_the_runs_they_name():
    from tools.dev.skinny_bf16_sweep import tuned_values
    from tools.dev.tune_decode_attention import long_shapes
    section = LINEAR["skinny_dense"]
    run = json.loads((ROOT / section["source"]).read_text())
    assert run["device"] == section["device"] and tuned_values(run) == _values(section)
    for name in ("decode_bf16_long", "decode_int8_long"):
        section = ATTENTION[name]
        run = json.loads((ROOT / section["source"]).read_text())
        assert run["info"]["device"] == section["device"] and long_shapes(run)[name] == _values(section), name


def test_a_missing_or_broken_file_gives_the_fallback_and_write_keeps_other_sections(tmp_path):
    anchor = str(tmp_path / "kernel.py")
    fallback = {"wide_n": 0}
    assert load_tuned(anchor, "skinny_dense", fallback) is fallback                 # no file
    path = tuned_path(anchor)
    path.parent.mkdir()
    path.write_text("{not json")
    assert load_tuned(anchor, "skinny_dense", fallback) is fallback                 # unreadable
    path.write_text(json.dumps({"other": {"a": 1}, "skinny_dense": [1]}))
    assert load_tuned(anchor, "skinny_dense", fallback) is fallback                 # not an object
    write_tuned(path, "skinny_dense", {"wide_n": 7}, source="run/x.json", device_name="GPU")
    assert load_tuned(anchor, "skinny_dense", fallback) == {"source": "run/x.json", "device": "GPU", "wide_n": 7}
    assert load_tuned(anchor, "other", fallback) == {"a": 1}
