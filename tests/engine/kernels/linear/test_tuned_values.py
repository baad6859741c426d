"""Tuned launch values kept as data (engine/kernels/tuned.py): the skinny GEMM's shapes in
engine/kernels/linear/tuned/h200.json are the ones the code used before they moved there, the tuner that writes them
(tools/dev/skinny_bf16_sweep.py --write) picks the same ones again from the run the file names, and a missing or
broken file falls back to the untuned defaults."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from engine.kernels.linear import skinny_gemm as Q
from engine.kernels.tuned import load_tuned, tuned_path, write_tuned

ROOT = Path(__file__).resolve().parents[4]
SECTION = json.loads(tuned_path(Q.__file__).read_text())["skinny_dense"]


def test_the_skinny_gemm_uses_the_shapes_it_had_in_code():
    narrow = Q.DenseConfig(block_n=64, block_k=256, num_stages=3, programs_per_sm=1)
    wide = Q.DenseConfig(block_n=128, block_k=128, num_stages=3)
    assert (Q.WIDE_N, Q.NARROW_CONFIG, Q.WIDE_CONFIG) == (65536, narrow, wide)
    assert (SECTION["wide_n"], SECTION["narrow"], SECTION["wide"]) == (65536, dataclasses.asdict(narrow),
                                                                       dataclasses.asdict(wide))
    assert Q.default_dense_config(2, 151936, 4096) == wide          # lm_head
    assert Q.default_dense_config(8, 24576, 4096) == narrow         # qwen3-8b gate_up, the widest layer


def test_the_tuner_picks_the_file_s_values_from_the_run_it_names():
    from tools.dev.skinny_bf16_sweep import tuned_values
    run = json.loads((ROOT / SECTION["source"]).read_text())
    assert run["device"] == SECTION["device"]
    assert tuned_values(run) == {k: v for k, v in SECTION.items() if k not in ("source", "device")}


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
