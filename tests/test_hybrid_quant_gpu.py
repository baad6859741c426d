"""The shared hybrid quantized by `ninfer quantize` (FP8 blocks, NVFP4) on CUDA: the bf16 Triton kernels
(the Gated DeltaNet projections, gated attention, the MLPs and the MTP layer all quantized) agree with
the float32 reference path in the logits; MTP at k = 3 and TP = 2 run and agree with k = 0 / TP = 1.
Comparisons as in tests/test_quant_gpu.py: bf16 greedy runs drift after a near-tie, so by agreement."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_hybrid_gpu import MODEL, PROMPTS
from test_quant_gpu import GREEDY, _agreement, _clear_top1

from engine import LLM

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core"),
              pytest.mark.skipif(not MODEL.exists(), reason=f"shared hybrid model not found at {MODEL}")]


@pytest.fixture(scope="module", params=["fp8", "nvfp4"])
def quantized(request, tmp_path_factory) -> str:
    from engine.quant.quantize import quantize_checkpoint
    out = tmp_path_factory.mktemp(f"hybrid-{request.param}") / "q"
    quantize_checkpoint(MODEL, out, request.param)
    return str(out)


def _llm(model: str, **kw) -> LLM:
    return LLM(model, device="cuda", kv_capacity=8192, max_batch=8, **kw)


def test_quantized_hybrid_logits_match_the_reference_path(quantized):
    bf16, fp32 = _llm(quantized), _llm(quantized, dtype="float32")
    assert bf16.engine.model_config.quant is not None
    for prompt in PROMPTS:
        a, b = bf16.prompt_logits(prompt).float(), fp32.prompt_logits(prompt)
        rel = float((a - b).abs().max() / b.abs().max())
        print(f"\n{prompt[:24]!r}: bf16 kernels vs float32 reference, max rel {rel:.3e}")
        assert rel < 0.05, rel
        clear = _clear_top1(b, float(b.max() - b.min()))
        assert bool((a.argmax(-1) == b.argmax(-1))[clear].all()), (prompt, int(clear.sum()))
    bf16.engine.executor.shutdown()
    fp32.engine.executor.shutdown()


def test_quantized_hybrid_mtp_and_tp2_agree_with_k0(quantized):
    one = _llm(quantized)
    k0 = [o.token_ids for o in one.generate(PROMPTS, GREEDY)]
    one.engine.executor.shutdown()
    runs = {"k=3": {"draft_tokens": 3}}
    if torch.cuda.device_count() >= 2:
        runs["TP=2 k=3"] = {"draft_tokens": 3, "tensor_parallel_size": 2}
    for name, kw in runs.items():
        llm = _llm(quantized, **kw)
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        llm.engine.executor.shutdown()
        print(f"\n{name} vs k=0: token agreement {_agreement(got, k0):.3f}")
        assert all(len(g) == GREEDY.max_tokens for g in got)
        assert _agreement(got, k0) >= 0.9
