"""Quantized experts on CUDA: a tiny Qwen3-MoE quantized by `ninfer quantize` (FP8 blocks, NVFP4) runs its sparse
layers through the Triton grouped GEMMs (engine.kernels.moe), which dequantize the experts in registers. In
float32 (IEEE dots) the prompt logits equal the CPU engine's, whose experts the reference dequantizes
(engine.quant.formats); in bf16 they agree within the usual bf16 margin, with the same top-1 wherever it is clear.
Marked `gpu`; skipped where CUDA is absent. The CPU twin is tests/engine/quant/test_moe_quant.py."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.layers.moe import SparseMoeBlock
from tests.engine.models.test_qwen3_vs_transformers import random_prompts
from tests.support.moe import build_random_moe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PROMPTS = random_prompts(384, [3, 17, 40, 90], seed=22)


@pytest.fixture(scope="module", params=["fp8", "nvfp4"])
def quantized(request, tmp_path_factory):
    from engine.quant.quantize import quantize_checkpoint
    root = tmp_path_factory.mktemp(f"moe-gpu-{request.param}")
    build_random_moe(root / "bf", "qwen3_moe", seed=23)
    quantize_checkpoint(root / "bf", root / "q", request.param)
    cpu = LLM(str(root / "q"), device="cpu", dtype="float32", kv_capacity=2048)
    return request.param, str(root / "q"), [cpu.prompt_logits(ids) for ids in PROMPTS]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).norm() / b.norm())


def test_float32_quantized_experts_equal_the_cpu_engine(quantized):
    fmt, path, want = quantized
    llm = LLM(path, device="cuda", dtype="float32", kv_capacity=2048, enforce_eager=True)
    block = next(l.mlp for l in llm.engine.executor.driver.model.model.layers if isinstance(l.mlp, SparseMoeBlock))  # noqa: E741
    assert block.experts.quant == fmt
    for ids, ref in zip(PROMPTS, want):
        assert _relative(llm.prompt_logits(ids).cpu(), ref) < 1e-4, (fmt, len(ids))
    llm.engine.executor.shutdown()


def test_bf16_quantized_experts_agree_with_the_cpu_engine(quantized):
    fmt, path, want = quantized
    llm = LLM(path, device="cuda", dtype="bfloat16", kv_capacity=2048)
    for ids, ref in zip(PROMPTS, want):
        got = llm.prompt_logits(ids).float().cpu()
        assert _relative(got, ref) < 0.05, (fmt, len(ids))
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.05 * float(ref.max() - ref.min())
        assert bool((got.argmax(-1) == ref.argmax(-1))[clear].all()), (fmt, len(ids))
    llm.engine.executor.shutdown()
