"""Prefix reuse on the shared model: a repeated prompt computes only its tail (cached_tokens counts the
rest) and produces the same output -- with MTP speculation the same drafts too, so the cached MTP
entries are exact; prompts ending on a block boundary still compute at least one token; a block is
keyed with the token after it; blocks written while decoding are reusable; prefix_reuse=False never
caches."""

from __future__ import annotations

import pytest

from tests.conftest import WORKLOADS, assert_kv_idle, make_llm
from engine import SamplingParams

BS = 16


@pytest.fixture(scope="module", params=[0, 3], ids=["k0", "k3"])
def llm(request, shared_model):
    return make_llm(shared_model, draft_tokens=request.param, prefill_chunk=32)


@pytest.fixture(scope="module")
def no_reuse(shared_model):
    return make_llm(shared_model, prefix_reuse=False)


def tokens_of(llm, text: str, n: int) -> list[int]:
    ids = llm.tokenizer.encode(text)
    assert len(ids) >= n
    return ids[:n]


PARAMS = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)


@pytest.mark.parametrize("n", [70, 64, 65, 17, 16, 5])
def test_repeated_prompt_computes_only_the_tail(llm, no_reuse, n):
    prompt = tokens_of(llm, "\n".join(WORKLOADS["code"]) + str(n), n)
    prompt = [(t + n) % 8000 + 1 for t in prompt]           # unique per case: nothing cached before
    first = llm.generate([prompt], PARAMS)[0]
    second = llm.generate([prompt], PARAMS)[0]
    cached = (n - 1) // BS * BS                              # full blocks whose next token is in the prompt
    assert first.stats.usage.cached_tokens == 0 and first.stats.usage.computed_prefill_tokens == n
    assert second.stats.usage.cached_tokens == cached
    assert second.stats.usage.computed_prefill_tokens == n - cached >= 1
    assert second.token_ids == first.token_ids == no_reuse.generate([prompt], PARAMS)[0].token_ids
    assert second.stats.speculative == first.stats.speculative   # identical drafts: MTP cache exact
    assert_kv_idle(llm.engine)


def test_block_key_includes_the_next_token(llm, no_reuse):
    base = [(t * 13) % 8000 + 1 for t in tokens_of(llm, WORKLOADS["json"][0], 48)]
    llm.generate([base], PARAMS)
    # equal up to position 31, different token at 32: block 1 (16..31) is keyed with token 32
    forked = base[:32] + [(base[32] + 1) % 8000 + 1] + base[33:]
    out = llm.generate([forked], PARAMS)[0]
    assert out.stats.usage.cached_tokens == 16
    assert out.token_ids == no_reuse.generate([forked], PARAMS)[0].token_ids


def test_blocks_written_while_decoding_are_reused(llm, no_reuse):
    prompt = tokens_of(llm, WORKLOADS["enumeration"][1] + WORKLOADS["prose"][0], 20)
    first = llm.generate([prompt], SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.0))[0]
    follow = prompt + first.token_ids[:45]                   # 65 tokens: 4 blocks, 2 of them decoded
    out = llm.generate([follow], SamplingParams(max_tokens=15, ignore_eos=True, temperature=0.0))[0]
    assert out.stats.usage.cached_tokens == 64
    assert out.token_ids == first.token_ids[45:60]           # the greedy continuation
    assert out.token_ids == no_reuse.generate([follow], SamplingParams(max_tokens=15, ignore_eos=True, temperature=0.0))[0].token_ids
    assert_kv_idle(llm.engine)


def test_prefix_reuse_off_never_caches(no_reuse):
    prompt = list(range(100, 180))
    outs = [no_reuse.generate([prompt], PARAMS)[0] for _ in range(2)]
    assert [o.stats.usage.cached_tokens for o in outs] == [0, 0]
    assert [o.stats.usage.computed_prefill_tokens for o in outs] == [80, 80]
    assert outs[0].token_ids == outs[1].token_ids


def test_identical_prompts_in_one_batch_share_blocks(llm):
    prompt = [(t * 7) % 8000 + 1 for t in range(3, 83)]
    outs = llm.generate([prompt, prompt, prompt], PARAMS)
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    # the lane prefills one request at a time: the later ones find the first one's registered blocks
    assert [o.stats.usage.cached_tokens for o in outs] == [0, 64, 64]
    assert_kv_idle(llm.engine)
