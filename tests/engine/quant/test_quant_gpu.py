"""Quantized checkpoints on CUDA through the engine: the Triton kernels (bf16 activations, CUDA graphs,
MTP, TP=2) agree with the reference path (float32 activations dequantize with engine.quant.formats)
in the logits; greedy runs in bf16 are compared with each other (graphs vs eager, k=3 vs k=0, TP2 vs
TP1): against the float32 path a bf16 greedy continuation drifts after the first near-tie (0.63 token
agreement measured on the H200, bench/results/2026-11-30-h200-quant-kernels/pytest.log).

Marked gpu / multi_gpu; skipped without CUDA or without the shared tiny model. bf16 rounding lets a
greedy continuation drift once two tokens are close, so sequences are compared by token agreement.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams

_ROOT = Path(__file__).resolve().parents[3]
# the checkout's .models, the one beside it (a copy inside the main checkout), then ../shared/models
MODEL = next((p for p in (_ROOT / ".models" / "tiny-qwen3-mtp", _ROOT.parent / ".models" / "tiny-qwen3-mtp")
              if p.exists()), _ROOT.parent / "shared" / "models" / "tiny-qwen3-mtp")

pytestmark = [pytest.mark.skipif(not MODEL.exists(), reason=f"shared test model not found at {MODEL}")]

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    '{"order_id": "ORD-381901", "item": "printer", "quantity": 8}, {"order_id": "ORD-381902",',
    "Line 1: the quick brown fox jumps over the lazy dog.\nLine 2:",
    "The interpreter reads the source file and",
    # longer than the 64 rows of the skinny kernel: the prefill paths (FP8 block-scaled GEMM, NVFP4
    # dequantized to bf16)
    "".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(1, 12)) + "Line 12:",
]
GREEDY = SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.0)


@pytest.fixture(scope="module", params=["fp8", "nvfp4"])
def quantized(request, tmp_path_factory) -> str:
    from engine.quant.quantize import quantize_checkpoint
    out = tmp_path_factory.mktemp(request.param) / "q"
    quantize_checkpoint(MODEL, out, request.param)
    return str(out)


def _llm(model: str, **kw) -> LLM:
    return LLM(model, device="cuda", kv_capacity=8192, max_batch=8, **kw)       # warms up (graphs) itself


_RUNS: dict = {}


def _generate(model: str, **kw) -> list[list[int]]:
    """Greedy outputs of one engine setting (each setting built once per module: builds dominate)."""
    key = (model, tuple(sorted(kw.items())))
    if key not in _RUNS:
        llm = _llm(model, **kw)
        _RUNS[key] = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        llm.engine.executor.shutdown()
    return _RUNS[key]


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for s, t in zip(a, b) for x, y in zip(s, t)]
    return sum(x == y for x, y in pairs) / len(pairs)


def _clear_top1(logits: torch.Tensor, scale: float) -> torch.Tensor:
    """Positions whose top-1 leads its runner-up by more than 5% of the logits' range: there a bf16 path
    must pick the same token (a near-tie may go either way)."""
    top2 = logits.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]) > 0.05 * scale


def assert_kernels_match_the_reference_path(model: str, prompts: list[str]) -> None:
    """The quantized checkpoint's bf16 kernels against its float32 reference path: prompt logits within
    5 % of the largest, and the same top-1 wherever it is clear."""
    bf16, fp32 = _llm(model), _llm(model, dtype="float32")
    assert bf16.engine.model_config.quant is not None
    for prompt in prompts:
        a, b = bf16.prompt_logits(prompt).float(), fp32.prompt_logits(prompt)
        rel = float((a - b).abs().max() / b.abs().max())
        print(f"\n{prompt[:24]!r}: bf16 kernels vs float32 reference, max rel {rel:.3e}")
        assert rel < 0.05, rel
        clear = _clear_top1(b, float(b.max() - b.min()))
        assert bool((a.argmax(-1) == b.argmax(-1))[clear].all()), (prompt, int(clear.sum()))
    bf16.engine.executor.shutdown()
    fp32.engine.executor.shutdown()


def test_kernels_logits_match_the_reference_path(quantized):
    assert_kernels_match_the_reference_path(quantized, PROMPTS)


def test_graphs_equal_eager(quantized):
    assert _agreement(_generate(quantized), _generate(quantized, enforce_eager=True)) >= 0.95


def test_mtp_speculation_agrees_with_k0(quantized):
    assert _agreement(_generate(quantized, draft_tokens=3), _generate(quantized)) >= 0.9


