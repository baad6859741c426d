"""Proof by compilation: the engine's Triton kernels compiled offline (no GPU) for sm70, sm75, sm80, sm89 and sm90,
and the capability selector (engine/platform.py) checked against the results: a family it selects on a capability
compiles there, and the capability-only families (FP8, PDL) are selected exactly where they compile.

The fast set runs in CI (a fresh process, ~35-41 s of CPU); `NINFER_COMPILE_MATRIX_FULL=1` adds the
prefill-shaped attention and both dtypes everywhere (sm70's prefill attention alone compiles for ~100 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import envs
from engine.errors import InvalidArgumentError
from engine.platform import select_paths

pytest.importorskip("triton", reason="the compile matrix needs Triton's compiler")
REPO = Path(__file__).resolve().parents[3]
FULL = envs.COMPILE_MATRIX_FULL.read()
# CPU seconds (this process and its ptxas children): wall time on a shared 2-core machine says more about the
# neighbours. Measured 2026-12-05: ~35-41 s of CPU for the fast set (93 compiles).
FAST_BUDGET_CPU_S = 75


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("compile") / "matrix.json"
    # a fresh process: the kernel tests switch Triton to its interpreter in theirs, and a cold cache of its own
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", envs.TRITON_INTERPRET_TESTS.name)}
    env["TRITON_CACHE_DIR"] = str(out.parent / "triton-cache")
    done = subprocess.run([sys.executable, "-m", "tests.support.compile_matrix", str(out), *(["--full"] if FULL else [])],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    print("\n".join(f"{r['scenario']:28s} {r['kernel']:22s} sm{r['capability']:<3d} {'OK' if r['ok'] else 'FAIL ' + r['error']}"
                    for r in data["results"]))
    print(f"compiled {len(data['results'])} (kernel, capability) pairs in {data['seconds']:.0f} s "
          f"({data['cpu_seconds']:.0f} s of CPU)")
    return data


def selects(family: str, capability: int, dtype: str) -> bool:
    """Whether engine/platform.py would launch this family's kernels on sm<capability> in `dtype`."""
    try:
        p = select_paths((capability // 10, capability % 10), dtype)
    except InvalidArgumentError:
        return False                       # bf16 below sm80: refused before anything launches
    return {"elementwise": p.elementwise == "triton", "gated_delta": p.gated_delta == "triton",
            "attention": p.attention_decode == "triton-paged",
            "attention_tma": p.attention_prefill == "triton-tma-prefill",
            "fp8_linear": p.fp8_linear == "fp8-gemv+scaled-mm",
            "nvfp4_linear": p.nvfp4_linear in ("triton-gemv", "mma-gemv+triton-gemv"),
            "fp8_activation_quant": p.fp8_activation_quant, "pdl": p.pdl,
            "dense_linear": p.dense_linear == "triton-gemv+skinny"}[family]


def scenario_dtype(name: str) -> str:
    return "float16" if name.endswith("_f16") else "bfloat16" if name.endswith("_bf16") else "auto"


def test_every_selected_family_compiles_for_its_capability(matrix):
    failed = [r for r in matrix["results"] if not r["ok"]
              and selects(matrix["families"][r["scenario"]], r["capability"], scenario_dtype(r["scenario"]))]
    assert not failed, "\n".join(f"{r['scenario']} sm{r['capability']}: {r['error']}" for r in failed)


@pytest.mark.parametrize("family", ["fp8_linear", "fp8_activation_quant", "pdl"])
def test_capability_only_families_are_selected_exactly_where_they_compile(matrix, family):
    rows = [r for r in matrix["results"] if matrix["families"][r["scenario"]] == family]
    assert rows
    for r in rows:
        assert r["ok"] == selects(family, r["capability"], scenario_dtype(r["scenario"])), r


def test_every_capability_compiles_the_kernels_its_dtype_needs(matrix):
    caps = {r["capability"] for r in matrix["results"] if r["ok"]}
    assert caps == {70, 75, 80, 89, 90}
    kernels = {(r["kernel"], r["capability"]) for r in matrix["results"] if r["ok"]}
    for cap in (70, 75, 80, 89, 90):
        for kernel in ("_attn_kernel", "_qk_norm_rope_kernel", "_rms_norm_kernel", "_write_kv_kernel",
                       "_recurrent_kernel", "gemv_kernel", "_skinny_dense_kernel"):
            assert (kernel, cap) in kernels, (kernel, cap)


def test_qk_norm_rope_compiles_for_every_padded_kv_head_count(matrix):
    """The kernel once named one variable in both branches with shapes [Q_BLOCK, HALF] and [KV_HEADS_PAD, HALF]:
    its K-storing form (return_k=True) compiled only where the padded KV heads were 8. Both forms are captured."""
    rows = [r for r in matrix["results"] if r["scenario"].startswith("qk_norm_rope_")]
    assert {r["scenario"].split("_")[3] for r in rows} == {"kvh2", "kvh4", "kvh8"}
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert len(rows) == 2 * len({(r["scenario"], r["capability"]) for r in rows})     # return_k True and False


def test_the_fast_matrix_stays_within_its_ci_budget(matrix):
    if FULL:
        pytest.skip("the full matrix has no budget")
    assert matrix["cpu_seconds"] < FAST_BUDGET_CPU_S, (matrix["cpu_seconds"], matrix["seconds"])
