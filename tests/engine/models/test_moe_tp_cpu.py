"""Tensor parallelism of the MoE models on the CPU (two ranks on the local communicator): every expert split
on its intermediate dimension (gate and up rows, down columns), the shared expert likewise, the router and
the shared expert's gate replicated; one all-reduce per MoE layer, fused with the residual add and the next
norm. TP=2 computes what TP=1 computes: logits, and greedy with and without MTP drafts."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.layers.moe import SparseMoeBlock
from tests.conftest import assert_kv_idle, make_llm
from tests.engine.models.test_qwen3_vs_transformers import random_prompts
from tests.support.moe import build_random_moe

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next", "qwen3_5_moe"])
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tp-{request.param}")
    build_random_moe(path, request.param, seed=4, echo_mtp=1.2)
    return request.param, str(path), make_llm(str(path), prefill_chunk=16), make_llm(str(path), tensor_parallel_size=2,
                                                                                    prefill_chunk=16)


def test_each_rank_holds_half_of_every_expert(pair):
    arch, _, one, two = pair
    full = [l.mlp for l in one.engine.executor.driver.model.model.layers if isinstance(l.mlp, SparseMoeBlock)]  # noqa: E741
    for runner in two.engine.executor.runners:
        blocks = [l.mlp for l in runner.model.model.layers if isinstance(l.mlp, SparseMoeBlock)]  # noqa: E741
        for half, whole in zip(blocks, full):
            assert half.experts.w13_weight.shape == (8, 32, 64) and half.experts.w2_weight.shape == (8, 64, 16)
            assert half.gate.weight.shape == whole.gate.weight.shape == (8, 64)        # the router is replicated
            assert not half.reduce                                                    # reduced with the next norm
            i = half.experts.intermediate
            rank = runner.tp.rank
            assert (half.experts.w13_weight[:, :i] == whole.experts.w13_weight[:, rank * i:(rank + 1) * i]).all()
            assert (half.experts.w13_weight[:, i:] == whole.experts.w13_weight[:, 32 + rank * i:32 + (rank + 1) * i]).all()
            assert (half.experts.w2_weight == whole.experts.w2_weight[:, :, rank * i:(rank + 1) * i]).all()
            if arch != "qwen3_moe":
                assert half.shared_expert.down_proj.in_features == 24


def test_tp2_prompt_logits_equal_tp1(pair):
    _, _, one, two = pair
    for ids in random_prompts(384, [7, 33, 60], seed=5):
        a, b = one.prompt_logits(ids), two.prompt_logits(ids)
        rel = float((a - b).abs().max() / a.abs().max())
        assert rel < 1e-5, f"TP=2 logits differ from TP=1 by {rel:.2e}"


@pytest.mark.parametrize("k", [0, 3])
def test_tp2_greedy_equals_tp1(pair, k):
    arch, path, one, _ = pair
    if k and arch == "qwen3_moe":
        pytest.skip("Qwen3-MoE checkpoints have no MTP layer")
    prompts = random_prompts(384, [4, 21, 50], seed=6)
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0)
    want = [o.token_ids for o in one.generate(prompts, params)]
    two = make_llm(path, tensor_parallel_size=2, draft_tokens=k, prefill_chunk=16)
    outs = two.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    if k:
        assert sum(o.stats.speculative.accepted for o in outs) > 0
    assert_kv_idle(two.engine)
