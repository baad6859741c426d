"""Penalties, bias, bad words, min_tokens and min_p through the whole engine on the shared model:
greedy output with every option on equals the formula applied to transformers' float32 logits
(tests/support/sampling_reference), k = 3 equals k = 0, TP = 2 equals TP = 1, and nothing leaks."""

from __future__ import annotations

import pytest

from engine import InvalidArgumentError, SamplingParams
from tests.conftest import WORKLOADS, assert_kv_idle, make_llm
from tests.support.sampling_reference import load_reference_model, reference_greedy

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Line 1: the quick brown fox jumps over the lazy dog.\nLine 2:",
    WORKLOADS["json"][1],
]
EVERY_OPTION = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3, min_tokens=6,
                    logit_bias={11: 2.5, 198: -1.5, 1232: 4.0}, bad_words=["fox", " return", "the"])
N = 24


def options_for(llm, **extra):
    return SamplingParams(**{"max_tokens": N, "temperature": 0.0, **EVERY_OPTION, **extra})


@pytest.fixture(scope="module")
def reference(shared_model):
    return load_reference_model(shared_model)


def reference_tokens(llm, reference, prompt: str, params: SamplingParams) -> list[int]:
    core = llm.engine
    ids = llm.tokenizer.encode(prompt)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(core.model_config.eos_token_ids))
    from engine.sched.admission import bad_words_token_ids
    words = [list(w) for w in bad_words_token_ids(params.bad_words or [], llm.tokenizer, core.model_config.vocab_size)]
    out = reference_greedy(reference, ids, params.max_tokens, presence=params.presence_penalty,
                           frequency=params.frequency_penalty, repetition=params.repetition_penalty,
                           min_tokens=params.min_tokens, stop_ids=stops, logit_bias=params.logit_bias, bad_words=words)
    for i, t in enumerate(out):                       # the engine stops at EOS (min_tokens keeps it away first)
        if t in stops:
            return out[:i + 1]
    return out


def test_greedy_with_every_option_follows_the_formula_on_the_reference_logits(llm_k0, reference):
    outs = llm_k0.generate(PROMPTS, options_for(llm_k0))
    plain = llm_k0.generate(PROMPTS, SamplingParams(max_tokens=N, temperature=0.0))
    for prompt, out, base in zip(PROMPTS, outs, plain):
        assert out.token_ids == reference_tokens(llm_k0, reference, prompt, options_for(llm_k0))
        assert out.token_ids != base.token_ids                   # the options changed something
    assert_kv_idle(llm_k0.engine)


@pytest.mark.parametrize("option", sorted(EVERY_OPTION))
def test_each_option_alone_follows_the_formula(llm_k0, reference, option):
    params = SamplingParams(max_tokens=12, temperature=0.0, **{option: EVERY_OPTION[option]})
    out = llm_k0.generate([PROMPTS[1]], params)[0]
    assert out.token_ids == reference_tokens(llm_k0, reference, PROMPTS[1], params)


def test_speculation_k3_equals_k0_with_every_option_on(llm_k0, llm_k3):
    params = options_for(llm_k0, max_tokens=40)
    want = [o.token_ids for o in llm_k0.generate(PROMPTS, params)]
    got = llm_k3.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == want
    assert sum(o.stats.speculative.accepted for o in got) > 0          # drafts were kept, not all rejected
    # one request with options among requests without: each keeps its own output
    mixed = llm_k3.generate(PROMPTS, [params, SamplingParams(max_tokens=40, temperature=0.0), params])
    assert mixed[0].token_ids == want[0] and mixed[2].token_ids == want[2]
    assert mixed[1].token_ids == llm_k0.generate([PROMPTS[1]], SamplingParams(max_tokens=40, temperature=0.0))[0].token_ids
    assert_kv_idle(llm_k3.engine)


def test_tensor_parallel_two_ranks_equal_one_with_every_option_on(shared_model, llm_k0):
    params = options_for(llm_k0)
    tp2 = make_llm(shared_model, tensor_parallel_size=2, draft_tokens=2)
    try:
        assert [o.token_ids for o in tp2.generate(PROMPTS, params)] == \
               [o.token_ids for o in llm_k0.generate(PROMPTS, params)]
        assert_kv_idle(tp2.engine)
    finally:
        tp2.engine.shutdown()


def test_min_tokens_holds_eos_back_then_lets_it_stop(llm_k0):
    eos_prompt = '{"'                                  # greedy: one JSON record, then EOS (tests/engine/test_stop.py)
    free = llm_k0.generate([eos_prompt], SamplingParams(max_tokens=120, temperature=0.0))[0]
    assert free.token_ids[-1] == 0 and free.finish_reason.value == "stop"
    held = llm_k0.generate([eos_prompt], SamplingParams(max_tokens=120, temperature=0.0,
                                                        min_tokens=len(free.token_ids) + 5))[0]
    assert 0 not in held.token_ids[:len(free.token_ids) + 5]
    assert len(held.token_ids) >= len(free.token_ids) + 5


def test_bias_and_bad_words_bind_sampled_rows_too(llm_k3):
    fox = llm_k3.tokenizer.encode("fox")
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=3, bad_words=["fox"], logit_bias={278: -100.0})
    for out in llm_k3.generate([PROMPTS[1]] * 3, [SamplingParams(**{**vars(params), "seed": s}) for s in range(3)]):
        ids = out.token_ids
        assert 278 not in ids
        assert all(ids[i:i + len(fox)] != fox for i in range(len(ids)))
    forced = llm_k3.generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=1.0, logit_bias={42: 100.0}))[0]
    assert forced.token_ids == [42] * 5


def test_min_p_one_keeps_only_the_top_token(llm_k0):
    greedy = llm_k0.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    top_only = llm_k0.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=1.5, min_p=1.0, seed=9,
                                                       ignore_eos=True))
    assert [o.token_ids for o in top_only] == [o.token_ids for o in greedy]


@pytest.mark.parametrize("params, field, fragment", [
    (dict(logit_bias={8192: 1.0}), "logit_bias", "token id 8192 is outside the vocabulary [0, 8192)"),
    (dict(bad_words=["the quick brown fox jumps over the lazy dog again"]), "bad_words", "at most 8 per word"),
])
def test_options_that_need_the_model_are_refused_at_admission(llm_k0, params, field, fragment):
    with pytest.raises(InvalidArgumentError) as e:
        llm_k0.engine.add_request("hi", SamplingParams(**params))
    assert e.value.field == field and fragment in str(e.value), str(e.value)
    assert_kv_idle(llm_k0.engine)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm_k0):
    ids = llm_k0.tokenizer.encode(PROMPTS[0])
    out = llm_k0.generate([ids], SamplingParams(max_tokens=4, temperature=0.0, truncate_prompt_tokens=5))[0]
    assert out.prompt_token_ids == ids[-5:]
    assert out.token_ids == llm_k0.generate([ids[-5:]], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids


def test_special_tokens_kept_or_skipped_in_the_text(llm_k0):
    tok = llm_k0.tokenizer
    ids = [1] + tok.encode("user") + [2]                       # <|im_start|>user<|im_end|>
    assert tok.decode(ids) == "user"
    assert tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False) == "<|im_start|>user<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=True) == "<|im_start|> user <|im_end|>"
