"""Speculative decoding is lossless under greedy: with k = 1, 2, 3, 5 MTP drafts the engine emits
exactly the k = 0 tokens, for a mixed batch generated together (different prompt lengths, max_tokens
that end mid-round, EOS honoured or ignored, a per-request k below the engine's), with prefix reuse on
(a second pass over the same batch hits the cache) and off, and with an int8 KV cache."""

from __future__ import annotations

import pytest

from tests.conftest import MIXED_PROMPTS, WORKLOADS, make_llm
from engine import SamplingParams

PROMPTS = MIXED_PROMPTS + [
    MIXED_PROMPTS[0],                                   # a duplicate in the same batch
    WORKLOADS["json"][0] + 'printer", "quantity": 8',   # extends another prompt
    WORKLOADS["prose"][1],
]
PARAMS = [SamplingParams(max_tokens=m, ignore_eos=ie, draft_tokens=dk, temperature=0.0) for m, ie, dk in [
    (40, True, None), (33, True, None), (40, True, None), (29, True, None), (40, False, None), (40, True, 1),
    (40, True, None), (17, True, None), (40, False, None),
]]
assert len(PROMPTS) == len(PARAMS)


def generate(llm):
    outs = llm.generate(PROMPTS, PARAMS)
    return [o.token_ids for o in outs], outs


@pytest.fixture(scope="module")
def reference(shared_model):
    tokens, outs = generate(make_llm(shared_model, prefix_reuse=False))
    assert all(len(t) >= 1 for t in tokens)
    return tokens


@pytest.fixture(scope="module")
def reference_int8(shared_model):
    return generate(make_llm(shared_model, kv_dtype="int8", prefix_reuse=False))[0]


def check_lossless(llm, reference, k):
    for attempt in ("cold", "prefix cache warm"):
        tokens, outs = generate(llm)
        for i, (got, want) in enumerate(zip(tokens, reference)):
            assert got == want, f"k={k} {attempt}: prompt {i} diverges at token " \
                f"{next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))}"
        for out, params in zip(outs, PARAMS):
            spec = out.stats.speculative
            k_r = k if params.draft_tokens is None else min(k, params.draft_tokens)
            assert spec.draft_tokens == k_r and len(spec.accepted_per_position) == k_r
            assert spec.drafted == spec.rounds * k_r
            # every round emits its accepted drafts plus one token (the last round may be cut short)
            assert spec.rounds + spec.accepted >= out.stats.usage.completion_tokens - 1
        if attempt == "cold":
            assert sum(o.stats.usage.cached_tokens for o in outs) > 0     # the duplicate shares blocks
        else:
            assert all(o.stats.usage.cached_tokens > 0 for o, p in zip(outs, PROMPTS)
                       if len(llm.tokenizer.encode(p)) > 16)
        total = sum(o.stats.speculative.accepted for o in outs)
        assert total > 0                               # drafts really were accepted


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_greedy_with_k_drafts_equals_k0(shared_model, reference, k):
    check_lossless(make_llm(shared_model, draft_tokens=k), reference, k)


def test_greedy_k3_without_prefix_reuse_equals_k0(shared_model, reference):
    llm = make_llm(shared_model, draft_tokens=3, prefix_reuse=False)
    tokens, outs = generate(llm)
    assert tokens == reference
    assert all(o.stats.usage.cached_tokens == 0 for o in outs)


@pytest.mark.parametrize("k", [3])                 # k = 1, 2, 3, 5 over the float KV above; int8 adds its scales
def test_greedy_int8_kv_with_k_drafts_equals_int8_k0(shared_model, reference_int8, k):
    check_lossless(make_llm(shared_model, draft_tokens=k, kv_dtype="int8"), reference_int8, k)
