"""The shared hybrid quantized by `ninfer quantize` (FP8 blocks, NVFP4) on CUDA: the bf16 Triton kernels
(the Gated DeltaNet projections, gated attention, the MLPs and the MTP layer all quantized) agree with
the float32 reference path in the logits; MTP at k = 3 runs and agrees with k = 0 (TP = 2:
test_hybrid_quant_multi_gpu.py).
Comparisons as in tests/engine/quant/test_quant_gpu.py: bf16 greedy runs drift after a near-tie, so by agreement."""

from __future__ import annotations

import importlib.util

import pytest

from tests.engine.models.test_hybrid_gpu import MODEL, PROMPTS
from tests.engine.quant.test_quant_gpu import (
    GREEDY,
    _agreement,
    _llm,
    assert_kernels_match_the_reference_path,
)

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core"),
              pytest.mark.skipif(not MODEL.exists(), reason=f"shared hybrid model not found at {MODEL}")]


@pytest.fixture(scope="module", params=["fp8", "nvfp4"])
def quantized(request, tmp_path_factory) -> str:
    from engine.quant.quantize import quantize_checkpoint
    out = tmp_path_factory.mktemp(f"hybrid-{request.param}") / "q"
    quantize_checkpoint(MODEL, out, request.param)
    return str(out)


def test_quantized_hybrid_logits_match_the_reference_path(quantized):
    assert_kernels_match_the_reference_path(quantized, PROMPTS)


def test_quantized_hybrid_mtp_agrees_with_k0(quantized):
    check_agrees_with_k0(quantized, draft_tokens=3)


def check_agrees_with_k0(quantized: str, **kw) -> None:
    """Greedy tokens of the quantized hybrid with `kw` (k = 3, TP = 2) against its own k = 0 run."""
    one = _llm(quantized)
    k0 = [o.token_ids for o in one.generate(PROMPTS, GREEDY)]
    one.engine.executor.shutdown()
    llm = _llm(quantized, **kw)
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    llm.engine.executor.shutdown()
    print(f"\n{kw} vs k=0: token agreement {_agreement(got, k0):.3f}")
    assert all(len(g) == GREEDY.max_tokens for g in got)
    assert _agreement(got, k0) >= 0.9
