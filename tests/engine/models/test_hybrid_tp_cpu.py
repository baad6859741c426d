"""Tensor parallelism of the hybrid on the CPU (two ranks on the local communicator): linear-attention
key/value heads and their conv channels, and attention heads, split over the ranks; each rank keeps
the state of its own heads. TP=2 computes what TP=1 computes (logits, greedy with and without MTP)."""

from __future__ import annotations

import pytest

from tests.conftest import MIXED_PROMPTS, assert_kv_idle, make_llm
from engine import SamplingParams
from tests.support.hybrid import require_shared_hybrid


@pytest.fixture(scope="module")
def pair():
    path = require_shared_hybrid()
    return make_llm(path), make_llm(path, tensor_parallel_size=2, prefill_chunk=32)


def test_each_rank_holds_half_of_the_heads_and_state(pair):
    one, two = pair
    full = one.engine.executor.driver
    for runner in two.engine.executor.runners:
        delta = runner.model.linear_layers()[0]
        assert (delta.num_k_heads, delta.num_v_heads, delta.conv_channels) == (2, 4, 384)
        assert runner.states.layers[0].ssm.shape[1:] == (4, 48, 48)
        attn = runner.model.attention_layers()[0]
        assert (attn.num_heads, attn.num_kv_heads) == (3, 1)
        assert runner.states.bytes_per_slot * 2 == full.states.bytes_per_slot


def test_tp2_prompt_logits_equal_tp1(pair):
    one, two = pair
    for prompt in MIXED_PROMPTS[:4]:
        a, b = one.prompt_logits(prompt), two.prompt_logits(prompt)
        rel = float((a - b).abs().max() / a.abs().max())
        assert rel < 1e-5, f"TP=2 logits differ from TP=1 by {rel:.2e}"


@pytest.mark.parametrize("k", [0, 3])
def test_tp2_greedy_equals_tp1(pair, k):
    one, _ = pair
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    want = [o.token_ids for o in one.generate(MIXED_PROMPTS, params)]
    two = make_llm(require_shared_hybrid(), tensor_parallel_size=2, draft_tokens=k)
    assert [o.token_ids for o in two.generate(MIXED_PROMPTS, params)] == want
    assert_kv_idle(two.engine)
