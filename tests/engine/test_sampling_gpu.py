"""The sampling options, logprobs and n > 1 on CUDA, in the captured round: CUDA graphs equal eager and MTP
k = 3 equals k = 0 with every logit option on, logprobs of a graphed k = 3 run equal an eager k = 0 run's,
seeded n = 2 sequences replay identically graphed and eager, and nothing leaks.

Marked `gpu` by its name (tests/conftest.py); skipped without a CUDA device (CI). The CPU tests beside it
(test_sampling_options.py, test_logprobs.py, test_n_sequences.py) check the same options against
transformers' float32 logits; on a machine with CUDA they run there too (the engine's device is `auto`)."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.conftest import assert_kv_idle, make_llm

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Line 1: the quick brown fox jumps over the lazy dog.\nLine 2:",
    '{"order_id": "ORD-381901", "item": "printer", "quantity": 8}, {"order_id": "ORD-381902",',
]
EVERY_OPTION = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3, min_tokens=6, min_p=0.05,
                    logit_bias={11: 2.5, 198: -1.5, 1232: 4.0}, bad_words=["fox", " return", "the"])
LOGPROB_TOL = 2e-3


def _run(model: str, prompts, params, **config):
    llm = make_llm(model, device="cuda", max_batch=8, **config)
    try:
        outs = llm.generate(prompts, params)
        assert_kv_idle(llm.engine)
        return outs
    finally:
        llm.engine.executor.shutdown()


@pytest.fixture(scope="module")
def eager_k0_options(shared_model):
    return _run(shared_model, PROMPTS, SamplingParams(max_tokens=40, temperature=0.0, **EVERY_OPTION),
                draft_tokens=0, enforce_eager=True)


@pytest.mark.parametrize("k, eager", [(0, False), (3, False), (3, True)])
def test_every_option_graphed_and_speculative_equals_eager_k0(shared_model, eager_k0_options, k, eager):
    got = _run(shared_model, PROMPTS, SamplingParams(max_tokens=40, temperature=0.0, **EVERY_OPTION),
               draft_tokens=k, enforce_eager=eager)
    assert [o.token_ids for o in got] == [o.token_ids for o in eager_k0_options]
    if k:
        assert sum(o.stats.speculative.accepted for o in got) > 0


def test_logprobs_graphed_k3_equal_eager_k0(shared_model):
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=5, prompt_logprobs=3)
    want = _run(shared_model, PROMPTS, params, draft_tokens=0, enforce_eager=True)
    got = _run(shared_model, PROMPTS, params, draft_tokens=3)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert next(iter(pa)) == next(iter(pb))                    # the chosen token first
            top_a = sorted((v.logprob for v in pa.values()), reverse=True)
            top_b = sorted((v.logprob for v in pb.values()), reverse=True)
            assert len(top_a) == len(top_b) and all(abs(x - y) < LOGPROB_TOL for x, y in zip(top_a, top_b))
            for tid in set(pa) & set(pb):                              # a near tie may swap the 5th alternative
                assert abs(pa[tid].logprob - pb[tid].logprob) < LOGPROB_TOL
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)


@pytest.mark.parametrize("k", [0, 3])
def test_seeded_n2_sequences_replay_graphed_as_eager(shared_model, k):
    params = SamplingParams(n=2, max_tokens=32, temperature=1.0, top_p=0.95, seed=11, ignore_eos=True,
                            presence_penalty=0.3)
    want = _run(shared_model, PROMPTS[:2], params, draft_tokens=k, enforce_eager=True)
    got = _run(shared_model, PROMPTS[:2], params, draft_tokens=k)
    for a, b in zip(got, want):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert any(a.outputs[0].token_ids != a.outputs[1].token_ids for a in got)   # two sequences, not one twice
