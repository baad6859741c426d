"""The capability selector (engine/platform.py), driven for each compute capability and dtype on the CPU."""

from __future__ import annotations

import pytest

from engine.errors import InvalidArgumentError
from engine.platform import COMPILED_CAPABILITIES, capability_override, check_tp_comm, moe_family, select_paths

CAPS = [(7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0)]

# what each architecture gets with --dtype auto (docs/hardware.md's table says the same)
EXPECTED_AUTO = {
    (7, 0): ("float16", "triton-paged", "triton-paged", False, "torch-dequantize", "torch-dequantize", False),
    (7, 5): ("float16", "triton-paged", "triton-paged", False, "torch-dequantize", "torch-dequantize", False),
    (8, 0): ("bfloat16", "triton-paged", "triton-paged", False, "torch-dequantize", "torch-dequantize", False),
    (8, 6): ("bfloat16", "triton-paged", "triton-paged", False, "torch-dequantize", "torch-dequantize", False),
    (8, 9): ("bfloat16", "triton-paged", "triton-paged", False, "fp8-gemv+scaled-mm", "triton-gemv", True),
    (9, 0): ("bfloat16", "triton-paged", "triton-tma-prefill", True, "fp8-gemv+scaled-mm",
             "mma-gemv+triton-gemv", True),
}


@pytest.mark.parametrize("cap", CAPS, ids=lambda c: f"sm{c[0]}{c[1]}")
def test_each_capability_gets_its_families_with_auto_dtype(cap):
    p = select_paths(cap, "auto", "auto", "nvfp4")
    got = (p.dtype, p.attention_decode, p.attention_prefill, p.pdl, p.fp8_linear, p.nvfp4_linear,
           p.fp8_activation_quant)
    assert got == EXPECTED_AUTO[cap]
    assert p.capability == f"sm{cap[0]}{cap[1]}"
    assert (p.dtype_fallback != "") == (cap < (8, 0))          # says why auto is float16 there
    assert p.as_dict()["pdl"] in ("true", "false") and set(p.as_dict()) >= {"attention_decode", "nvfp4_linear"}


@pytest.mark.parametrize("cap", CAPS, ids=lambda c: f"sm{c[0]}{c[1]}")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "float16", "bfloat16"])
def test_each_capability_and_dtype_is_served_or_refused_naming_the_setting(cap, dtype, kv_dtype):
    refuse_dtype = dtype == "bfloat16" and cap < (8, 0)
    refuse_kv = kv_dtype == "bfloat16" and cap < (8, 0)
    if refuse_dtype or refuse_kv:
        with pytest.raises(InvalidArgumentError) as e:
            select_paths(cap, dtype, kv_dtype)
        assert e.value.field == ("dtype" if refuse_dtype else "kv_dtype") and f"sm{cap[0]}{cap[1]}" in str(e.value)
        if refuse_dtype:
            assert "--dtype float16" in str(e.value)
        return
    p = select_paths(cap, dtype, kv_dtype)
    assert p.dtype == dtype and p.dtype_fallback == ""
    half = dtype != "float32"
    # TMA, FP8 and the NVFP4 GEMV take 16-bit activations only; float32 runs the portable kernels
    assert (p.attention_prefill == "triton-tma-prefill") == (cap[0] == 9 and half)
    assert (p.fp8_linear == "fp8-gemv+scaled-mm") == (cap >= (8, 9) and half)
    assert p.pdl == (cap[0] >= 9)
    assert p.elementwise == "triton" and p.gated_delta == "triton" and p.dense_linear == "triton-gemv+skinny"
    # the MoE kernels compile for every capability in every expert format (float32: their IEEE dots); the
    # integer kernels take 16-bit activations only
    assert (p.moe_experts, p.moe_fp8_experts, p.moe_nvfp4_experts) == (
        "triton-grouped-gemm", "triton-grouped-gemm-dequant", "triton-grouped-gemm-dequant")
    assert p.int_linear == ("triton-int-gemv+gemm" if half else "torch-dequantize")
    # the CUDA C all-reduce: CUDA 13's NVRTC has no sm70 target
    assert p.tp_allreduce == ("nccl" if cap < (7, 5) else "p2p-one-shot+nccl")


def test_the_cpu_takes_the_torch_paths_and_float32_by_default():
    p = select_paths(None)
    assert p.capability == "cpu" and p.dtype == "float32" and p.attention_decode == "torch" and not p.pdl
    assert p.moe_experts == p.moe_fp8_experts == p.moe_nvfp4_experts == p.int_linear == "torch"
    assert p.tp_allreduce == "local"
    assert select_paths(None, "float16").dtype == "float16"


@pytest.mark.parametrize("cap,message", [((7, 0), "needs sm89"), ((8, 0), "needs sm89"),
                                         ((9, 0), "not implemented")])
def test_fp8_kv_is_refused_naming_kv_dtype(cap, message):
    with pytest.raises(InvalidArgumentError) as e:
        select_paths(cap, "auto", "fp8_e4m3")
    assert e.value.field == "kv_dtype" and message in str(e.value) and "int8" in str(e.value)


def test_an_fp8_checkpoint_in_float32_on_cuda_is_refused():
    with pytest.raises(InvalidArgumentError) as e:
        select_paths((9, 0), "float32", "auto", "fp8")
    assert e.value.field == "dtype"


def test_blackwell_takes_the_portable_attention_not_the_hopper_tma_kernels():
    p = select_paths((10, 0))
    assert p.attention_prefill == "triton-paged" and p.fp8_tensor_cores and p.pdl


def test_the_compile_matrix_covers_every_architecture_of_the_table():
    assert set(COMPILED_CAPABILITIES) == {(7, 0), (7, 5), (8, 0), (8, 9), (9, 0)}


def test_an_older_capability_can_be_chosen_on_a_newer_gpu_never_a_newer_one():
    assert capability_override("", (9, 0)) == (9, 0)
    assert capability_override("7.0", (9, 0)) == (7, 0) and capability_override("8.9", (9, 0)) == (8, 9)
    with pytest.raises(ValueError, match="newer than the device's sm80"):
        capability_override("9.0", (8, 0))
    with pytest.raises(ValueError, match="takes major.minor"):
        capability_override("sm70", (9, 0))


@pytest.mark.parametrize("cap", [None, (7, 0), (9, 0)], ids=["cpu", "sm70", "sm90"])
def test_each_expert_format_has_its_own_moe_family(cap):
    p = select_paths(cap)
    assert [moe_family(p, fmt) for fmt in (None, "fp8", "nvfp4")] == [p.moe_experts, p.moe_fp8_experts,
                                                                        p.moe_nvfp4_experts]
    assert set(p.as_dict()) >= {"moe_experts", "moe_fp8_experts", "moe_nvfp4_experts", "int_linear", "tp_allreduce"}


def test_p2p_all_reduce_is_refused_naming_tp_comm_where_its_kernels_are_not_selected():
    with pytest.raises(InvalidArgumentError) as e:
        check_tp_comm(select_paths((7, 0)), "p2p", 2)
    assert e.value.field == "tp_comm" and "sm70" in str(e.value) and "--tp-comm nccl" in str(e.value)
    for cap, comm, tp in (((7, 0), "auto", 2), ((7, 0), "p2p", 1), ((7, 5), "p2p", 2), (None, "p2p", 2)):
        check_tp_comm(select_paths(cap), comm, tp)            # auto falls back to NCCL; one rank all-reduces nothing
