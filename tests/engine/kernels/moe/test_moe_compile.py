"""Every MoE kernel specialization compiles for sm80, sm89 and sm90 (Triton's JIT down to the cubin, on a
machine without a GPU: tests/support/offline_compile.py). The FP8 and NVFP4 paths decode their bytes with
integer and fp16 operations only, so sm80 (which has no fp8 type) compiles them too.

Opt-in (a minute or more of ptxas on two cores): NINFER_TRITON_COMPILE_TESTS=1, triton importable, and not
under the interpreter (run it apart from the interpreter tests)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from engine import envs

pytestmark = pytest.mark.skipif(
    not envs.TRITON_COMPILE_TESTS.read() or importlib.util.find_spec("triton") is None
    or os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available(),
    reason="offline compile tests are opt-in: NINFER_TRITON_COMPILE_TESTS=1, triton, no interpreter, no GPU")

KERNELS = {"_route_kernel", "_count_kernel", "_offsets_kernel", "_place_kernel", "_route_sort_small_kernel",
           "_moe_gemm_kernel", "_combine_kernel"}


@pytest.mark.parametrize("arch", [80, 89, 90])
def test_every_moe_kernel_compiles(arch):
    from engine.kernels.moe import fused_moe
    from tests.engine.kernels.moe.test_moe_kernels import _experts
    from tests.support.offline_compile import compile_for
    names = set()
    for fmt in (None, "fp8", "nvfp4"):
        experts = _experts(fmt, 8, 256, 256, torch.bfloat16, seed=0)
        for tokens in (1, 3000):                    # one-launch routing and sort; the chunked sort
            x = torch.randn(tokens, 256, dtype=torch.bfloat16)
            logits = torch.randn(tokens, 8, dtype=torch.bfloat16)
            shared = torch.randn(tokens, 256, dtype=torch.bfloat16), torch.randn(tokens, 1, dtype=torch.bfloat16)
            with compile_for(arch) as compiled:
                fused_moe.sparse_moe(x, logits, experts, 2, True, *shared)
            names.update(compiled)
    assert names == KERNELS
