"""The MoE models on CUDA (the Triton path: engine.kernels.moe): float32 prompt logits equal the CPU engine's
(the torch reference path); bf16 greedy with CUDA graphs equals eager, k = 3 equals k = 0, TP = 2 equals
TP = 1 where two GPUs are lent. Marked `gpu`; skipped where CUDA is absent (and the hybrid without fla-core)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.models.test_qwen3_vs_transformers import random_prompts
from tests.support.moe import build_random_moe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PROMPTS = random_prompts(384, [3, 17, 40, 90], seed=21)
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def path(request, tmp_path_factory):
    if request.param == "qwen3_5_moe" and importlib.util.find_spec("fla") is None:
        pytest.skip("the hybrid's prefill needs fla-core on CUDA")
    p = tmp_path_factory.mktemp(f"gpu-{request.param}")
    build_random_moe(p, request.param, seed=20, echo_mtp=1.2)
    return request.param, str(p)


def test_float32_cuda_logits_equal_the_cpu_engine(path):
    _, p = path
    cuda = LLM(p, device="cuda", dtype="float32", kv_capacity=2048, prefill_chunk=32)
    cpu = LLM(p, device="cpu", dtype="float32", kv_capacity=2048, prefill_chunk=32)
    for ids in PROMPTS:
        a, b = cuda.prompt_logits(ids).cpu(), cpu.prompt_logits(ids)
        # CUDA's float32 matmuls run in TF32 on the tensor cores: 5.3e-4 on an H200 (2026-12-05, c56ef9a)
        assert float((a - b).norm() / b.norm()) < 2e-3


@pytest.mark.parametrize("k", [0, 3])
def test_bf16_graphs_equal_eager(path, k):
    arch, p = path
    if k and arch == "qwen3_moe":
        pytest.skip("Qwen3-MoE checkpoints have no MTP layer")
    eager = LLM(p, device="cuda", dtype="bfloat16", kv_capacity=4096, enforce_eager=True, draft_tokens=k)
    graphs = LLM(p, device="cuda", dtype="bfloat16", kv_capacity=4096, draft_tokens=k)
    assert graphs.engine.warmup_report.graph_buckets
    want = [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in graphs.generate(PROMPTS, GREEDY)] == want
    if k:
        k0 = LLM(p, device="cuda", dtype="bfloat16", kv_capacity=4096)
        assert [o.token_ids for o in k0.generate(PROMPTS, GREEDY)] == want


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp2_equals_tp1(path):
    _, p = path
    one = LLM(p, device="cuda", dtype="float32", kv_capacity=4096)
    two = LLM(p, device="cuda", dtype="float32", kv_capacity=4096, tensor_parallel_size=2)
    assert [o.token_ids for o in two.generate(PROMPTS, GREEDY)] == [o.token_ids for o in one.generate(PROMPTS, GREEDY)]
