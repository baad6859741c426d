"""The producers' checkpoints (tests/fixtures/quant) and `--quantization` on CUDA: the Triton kernels (bf16
activations: int_gemm, fp8_channel, the FP8-block and NVFP4 paths, CUDA graphs) against each checkpoint's float32
reference path in the logits, graphs against eager. Needs a CUDA device (written without one: first run on the
GPU machine)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.support import quant_layouts as ql

PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           # past the 64 rows of the skinny kernel: the prefill paths
           "".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(1, 8)) + "Line 8:"]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)


def _llm(model: str, **kw) -> LLM:
    return LLM(model, device="cuda", kv_capacity=2048, max_batch=8, **kw)


def _reference(model: str, **kw) -> LLM:
    """The float32 reference path on the CPU (engine/platform.py refuses FP8 checkpoints in float32 on CUDA)."""
    return LLM(model, device="cpu", dtype="float32", kv_capacity=2048, max_batch=8, **kw)


@pytest.mark.parametrize("name", ql.fixture_names())
def test_kernels_match_the_reference_path(name):
    path = str(ql.FIXTURES / name)
    bf16, fp32 = _llm(path), _reference(path)
    for prompt in PROMPTS:
        a, b = bf16.prompt_logits(prompt).float().cpu(), fp32.prompt_logits(prompt)
        assert float((a - b).abs().max() / b.abs().max()) < 0.05
    eager = _llm(path, enforce_eager=True)
    graphed = [o.token_ids for o in bf16.generate(PROMPTS, GREEDY)]
    same = sum(x == y for s, t in zip(graphed, (o.token_ids for o in eager.generate(PROMPTS, GREEDY)))
               for x, y in zip(s, t))
    assert same / sum(len(s) for s in graphed) >= 0.95
    for llm in (bf16, fp32, eager):
        llm.engine.executor.shutdown()


@pytest.mark.parametrize("method", ["fp8", "ptpc_fp8"])
def test_quantization_at_load_on_cuda(shared_model, method):
    bf16, fp32 = _llm(shared_model, quantization=method), _reference(shared_model, quantization=method)
    for prompt in PROMPTS:
        a, b = bf16.prompt_logits(prompt).float().cpu(), fp32.prompt_logits(prompt)
        assert float((a - b).abs().max() / b.abs().max()) < 0.05
