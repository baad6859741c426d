"""Proof by compilation: the engine's Triton kernels compiled offline (no GPU) for sm70, sm75, sm80, sm89 and sm90,
its CUDA C (.cu) through NVRTC for the same targets, and the capability selector (engine/platform.py) checked
against the results: a family it selects on a capability compiles there, and the capability-only families (FP8,
PDL, the CUDA C kernels) are selected exactly where they compile.

The fast set runs in CI (a fresh process; docs/hardware.md gives its CPU time); `NINFER_COMPILE_MATRIX_FULL=1`
adds the prefill-shaped attention, the MoE chunked sort on every capability, more integer variants and both
dtypes everywhere (sm70's prefill attention alone compiles for ~100 s)."""

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
# neighbours. Measured 2026-12-05 on the same loaded machine: 36 s of CPU for the 93 compiles of the dense
# families; with the MoE and integer kernels (46 more) and NVRTC's 9 compiles of the CUDA C (8 s), 64 s.
FAST_BUDGET_CPU_S = 110


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
          f"({data['cpu_seconds']:.0f} s of CPU; NVRTC: {data['nvrtc']})")
    return data


CUDA_C_FAMILIES = ("tp_allreduce", "quant_mma_gemv")
MOE_DECODE_KERNELS = ("_route_sort_small_kernel", "_moe_gemm_kernel", "_combine_kernel")
MOE_CHUNKED_SORT_KERNELS = ("_route_kernel", "_count_kernel", "_offsets_kernel", "_place_kernel")


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
            "dense_linear": p.dense_linear == "triton-gemv+skinny",
            "moe": p.moe_experts == "triton-grouped-gemm",
            "moe_fp8": p.moe_fp8_experts == "triton-grouped-gemm-dequant",
            "moe_nvfp4": p.moe_nvfp4_experts == "triton-grouped-gemm-dequant",
            "int_linear": p.int_linear == "triton-int-gemv+gemm",
            "tp_allreduce": p.tp_allreduce == "p2p-one-shot+nccl",
            "quant_mma_gemv": p.nvfp4_linear == "mma-gemv+triton-gemv"}[family]


def scenario_dtype(name: str) -> str:
    return "float16" if name.endswith("_f16") else "bfloat16" if name.endswith("_bf16") else "auto"


def test_every_selected_family_compiles_for_its_capability(matrix):
    failed = [r for r in matrix["results"] if not r["ok"]
              and selects(matrix["families"][r["scenario"]], r["capability"], scenario_dtype(r["scenario"]))]
    assert not failed, "\n".join(f"{r['scenario']} sm{r['capability']}: {r['error']}" for r in failed)


@pytest.mark.parametrize("family", ["fp8_linear", "fp8_activation_quant", "pdl", "tp_allreduce", "quant_mma_gemv"])
def test_capability_only_families_are_selected_exactly_where_they_compile(matrix, family):
    rows = [r for r in matrix["results"] if matrix["families"][r["scenario"]] == family]
    if not rows and family in CUDA_C_FAMILIES and matrix["nvrtc"] is None:
        pytest.skip("no libnvrtc (the test extra's nvidia-cuda-nvrtc, or NINFER_NVRTC_LIB)")
    assert rows
    for r in rows:
        assert r["ok"] == selects(family, r["capability"], scenario_dtype(r["scenario"])), r


def test_every_capability_compiles_the_kernels_its_dtype_needs(matrix):
    caps = {r["capability"] for r in matrix["results"] if r["ok"]}
    assert caps == {70, 75, 80, 89, 90}
    kernels = {(r["kernel"], r["capability"]) for r in matrix["results"] if r["ok"]}
    for cap in (70, 75, 80, 89, 90):
        for kernel in ("_attn_kernel", "_qk_norm_rope_kernel", "_rms_norm_kernel", "_write_kv_kernel",
                       "_recurrent_kernel", "gemv_kernel", "_skinny_dense_kernel", *MOE_DECODE_KERNELS,
                       "_int_gemv_kernel", "_int_gemm_kernel"):
            assert (kernel, cap) in kernels, (kernel, cap)
    # the prefill chunks' sort: on sm80 in CI, everywhere in the full matrix
    for cap in (70, 75, 80, 89, 90) if FULL else (80,):
        for kernel in MOE_CHUNKED_SORT_KERNELS:
            assert (kernel, cap) in kernels, (kernel, cap)


def test_moe_experts_compile_in_every_format_for_every_capability(matrix):
    """The grouped GEMM of 16-bit, FP8 and NVFP4 experts: the quantized bytes decode with integer operations
    in registers (weight-only), so even sm70 compiles them (the full matrix); the selector takes them everywhere."""
    for family in ("moe", "moe_fp8", "moe_nvfp4"):
        gemms = {r["capability"] for r in matrix["results"] if matrix["families"][r["scenario"]] == family
                 and r["kernel"] == "_moe_gemm_kernel" and r["ok"]}
        # CI compiles quantized experts for sm80+ (the full matrix: sm70/75 too)
        assert gemms == ({70, 75, 80, 89, 90} if family == "moe" or FULL else {80, 89, 90}), family
        assert all(selects(family, cap, "auto") for cap in gemms)


def test_the_integer_kernels_compile_without_spilling(matrix):
    """No stack or local memory. Known exception (the full matrix, 2026-12-05): the act-order GEMM at 64 rows
    spills 2-4 KB on sm70/75, where Triton's dot is FMA on [64, 64] float32 tiles: slow there, not wrong."""
    rows = [r for r in matrix["results"] if matrix["families"][r["scenario"]] == "int_linear"]
    assert {(r["kernel"], r["capability"]) for r in rows} >= {(k, c) for k in ("_int_gemv_kernel", "_int_gemm_kernel")
                                                               for c in (70, 75, 80, 89, 90)}
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    spilled = [r for r in rows if r["local_bytes"] != 0]
    assert all(r["capability"] < 80 and "act_order" in r["scenario"] for r in spilled), spilled


def test_every_cu_file_under_engine_compiles_through_nvrtc_and_the_sm90_only_ones_are_recorded(matrix):
    if matrix["nvrtc"] is None:
        pytest.skip("no libnvrtc (the test extra's nvidia-cuda-nvrtc, or NINFER_NVRTC_LIB)")
    rows = [r for r in matrix["results"] if matrix["families"][r["scenario"]] in CUDA_C_FAMILIES]
    covered = {f for r in rows for f in r["kernel"].split("+")}
    assert covered == {str(p.relative_to(REPO)) for p in (REPO / "engine").rglob("*.cu")}
    ok = {(r["scenario"], r["capability"]) for r in rows if r["ok"]}
    assert {c for s, c in ok if s == "cuda_p2p_allreduce"} == {75, 80, 89, 90}      # CUDA 13's NVRTC: no sm70
    sm70 = [r for r in rows if r["capability"] == 70]
    assert sm70 and all("gpu-architecture" in r["error"] for r in sm70), sm70
    # the MMA GEMV waits on griddepcontrol (PDL): an sm90 instruction, so sm90 only
    mma = [r for r in rows if r["scenario"] == "cuda_mma_gemv" and r["capability"] in (80, 89)]
    assert mma and all(not r["ok"] and "requires .target sm_90" in r["error"] for r in mma), mma
    assert ("cuda_mma_gemv", 90) in ok


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
