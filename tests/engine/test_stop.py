"""How a generation ends: EOS (finish_reason "stop", EOS token kept), ignore_eos (runs on to
max_tokens), max_tokens ("length"), stop_token_ids (token_ids end at that token) and stop strings
(text cut before the string, token_ids end at the token that completed it) -- with k = 0 and with
k = 3 speculative rounds that emit several tokens at once, so that an ending can fall mid-round.
Every ending frees the request's KV."""

from __future__ import annotations

import pytest

from tests.conftest import WORKLOADS, assert_kv_idle
from engine import SamplingParams

EOS_PROMPT = '{"'                     # greedy: one JSON record, then <|endoftext|> as the 60th token
EOS_AT = 60
CLOSED_RECORD = ('{"id": 133630, "name": "Omar Sato", "age": 67, "city": "Denver", '
                 '"email": "user133630@example.com", "active": true, "tags": ["staff", "beta"]}')
ENUM = WORKLOADS["enumeration"][0]


@pytest.fixture(params=["k0", "k3"])
def llm(request, llm_k0, llm_k3):
    return llm_k0 if request.param == "k0" else llm_k3


def gen(llm, prompt, **kw):
    kw.setdefault("temperature", 0.0)
    out = llm.generate([prompt], SamplingParams(**kw))[0]
    assert_kv_idle(llm.engine)
    return out


def test_eos_stops_and_ignore_eos_runs_on(llm):
    eos = llm.engine.model_config.eos_token_ids
    assert eos == (0,)
    out = gen(llm, EOS_PROMPT, max_tokens=80)
    assert out.finish_reason == "stop"
    assert len(out.token_ids) == EOS_AT and out.token_ids[-1] == 0 and 0 not in out.token_ids[:-1]
    assert out.text == llm.tokenizer.decode(out.token_ids) and "<|endoftext|>" not in out.text
    assert out.stats.usage.completion_tokens == EOS_AT and out.stats.finish_reason == "stop"
    on = gen(llm, EOS_PROMPT, max_tokens=EOS_AT + 6, ignore_eos=True)
    assert on.finish_reason == "length" and len(on.token_ids) == EOS_AT + 6
    assert on.token_ids[:EOS_AT] == out.token_ids


def test_eos_as_the_very_first_token(llm):
    out = gen(llm, CLOSED_RECORD, max_tokens=10)
    assert (out.token_ids, out.finish_reason, out.text) == ([0], "stop", "")


@pytest.mark.parametrize("max_tokens", [1, 2, 13])
def test_max_tokens_is_exact(llm, max_tokens):
    out = gen(llm, ENUM, max_tokens=max_tokens, ignore_eos=True)
    assert out.finish_reason == "length" and len(out.token_ids) == max_tokens
    assert out.stats.usage.completion_tokens == max_tokens


@pytest.fixture(scope="module")
def baseline(llm_k0):
    out = llm_k0.generate([ENUM], SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0))[0]
    return out.token_ids, out.text


def test_stop_token_ids_end_at_that_token(llm, baseline):
    tokens, _ = baseline
    j = next(i for i in range(7, len(tokens)) if tokens[i] not in tokens[:i])
    out = gen(llm, ENUM, max_tokens=40, ignore_eos=True, stop_token_ids=[tokens[j]])
    assert out.finish_reason == "stop" and out.token_ids == tokens[:j + 1]


def completing_index(llm, tokens: list[int], stop: str) -> int:
    return next(m for m in range(len(tokens)) if stop in llm.tokenizer.decode(tokens[:m + 1]))


@pytest.mark.parametrize("stop", ["Line 5:", "dog.\nLine 5: the", "fox"])
def test_stop_string_cuts_text_and_tokens(llm, baseline, stop):
    tokens, text = baseline
    assert stop in text
    out = gen(llm, ENUM, max_tokens=40, ignore_eos=True, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == text[:text.index(stop)]
    assert out.token_ids == tokens[:completing_index(llm, tokens, stop) + 1]
    assert out.stats.usage.completion_tokens == len(out.token_ids)


def test_earliest_of_several_stop_strings_wins(llm, baseline):
    tokens, text = baseline
    out = gen(llm, ENUM, max_tokens=40, ignore_eos=True, stop=["Line 7", "never there", "Line 5"])
    assert out.text == text[:text.index("Line 5")]
    assert out.token_ids == tokens[:completing_index(llm, tokens, "Line 5") + 1]


def test_absent_stop_string_runs_to_max_tokens(llm, baseline):
    tokens, text = baseline
    out = gen(llm, ENUM, max_tokens=40, ignore_eos=True, stop=["zebra crossing"])
    assert out.finish_reason == "length" and out.token_ids == tokens and out.text == text
