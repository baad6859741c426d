"""The engine's CUDA C (the NVFP4/FP8 tensor-core GEMV, engine/kernels/linear/quant_gemv_mma.cu) compiled by NVRTC
for each target the Triton matrix covers, and the selector checked against it: the kernel is selected on sm90
only, where it must compile. Skips without libnvrtc (not in the CPU install; see tests/support/nvrtc.py)."""

from __future__ import annotations

import pytest

from engine.platform import select_paths
from tests.support.nvrtc import NvrtcError, compile_cubin, find_libnvrtc

LIB = find_libnvrtc()
pytestmark = pytest.mark.skipif(LIB is None, reason="no libnvrtc (pip install nvidia-cuda-nvrtc, or NINFER_NVRTC_LIB)")


@pytest.mark.parametrize("capability", [75, 80, 89, 90])
def test_the_mma_gemv_compiles_where_the_selector_picks_it(capability):
    from engine.kernels.linear.quant_gemv_mma import CUDA_SOURCE, VARIANTS, _name
    names = tuple(_name(fmt, x_bf16, *VARIANTS[0]) for fmt in ("nvfp4", "fp8") for x_bf16 in (True, False))
    selected = select_paths((capability // 10, capability % 10)).nvfp4_linear == "mma-gemv+triton-gemv"
    try:
        cubin = compile_cubin(LIB, CUDA_SOURCE, capability, names)
    except NvrtcError as error:
        assert not selected, f"sm{capability} selects the MMA GEMV but NVRTC fails: {error}"
        print(f"sm{capability}: does not compile: {str(error).splitlines()[0]}")
        return
    assert cubin[:4] == b"\x7fELF"
    print(f"sm{capability}: {len(cubin)} B of cubin (selected: {selected})")
