"""Structured output together with the sampling fields (LLM.generate on the shared model, CPU): logprobs
are the model's distribution over the tokens the grammar allows (a position with one allowed token has
logprob 0, every alternative reported is allowed), greedy k = 3 equals k = 0 with penalties and
logprobs on, each of n sequences walks its own matcher, logit_bias steers between what the grammar
allows and cannot leave it, bad_words removes a token and the grammar finds another spelling, and
where min_tokens would ban every allowed token (EOS after a complete choice) the grammar wins; a
resumed (migrated) stream continues its grammar."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
import torch

from engine.request_stats import FinishReason
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.structured.bitmask import unpack
from tests.conftest import assert_kv_idle
from tests.engine.structured.helpers import SCHEMA
from tests.engine.structured.test_structured_generate import CONSTRAINTS, PROMPTS, obeys, params_for

OPTIONS = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2, logprobs=3)
COLORS = ("red", "green", "blue", "purple")


def walk(llm, params: SamplingParams, token_ids: list[int], logprobs) -> int:
    """Feed one sequence through a fresh matcher of its grammar: each token is allowed where it stands,
    and so is every alternative reported there with a finite logprob. -> positions that allowed one token
    (their logprob must be 0: the distribution is over the allowed tokens)."""
    core = llm.engine
    state = core.grammars.matcher(core.compile_grammar(params), core.model_config.eos_token_ids)
    row = torch.zeros(core.grammars.words, dtype=torch.int32)
    forced = 0
    for i, tok in enumerate(token_ids):
        state.fill(row)
        allowed = unpack(row.unsqueeze(0), core.model_config.vocab_size)[0]               # [V] bool
        assert allowed[tok], (i, tok)
        if logprobs is not None:
            for tid, lp in logprobs[i].items():
                assert allowed[tid] or lp.logprob == -math.inf, (i, tid, lp)
            if int(allowed.sum()) == 1:
                assert abs(logprobs[i][tok].logprob) < 1e-5, (i, logprobs[i][tok])
                forced += 1
        assert state.accept(tok), (i, tok)
    return forced


def finite(position) -> dict[int, float]:
    return {t: lp.logprob for t, lp in position.items() if lp.logprob > -math.inf}


def test_greedy_with_penalties_and_logprobs_k3_equals_k0(llm_k0, llm_k3):
    params = params_for(**OPTIONS)
    k0, k3 = llm_k0.generate(PROMPTS, params), llm_k3.generate(PROMPTS, params)
    assert [o.token_ids for o in k3] == [o.token_ids for o in k0]
    forced = 0
    for so, p, a, b in zip(CONSTRAINTS, params, k0, k3):
        if a.finish_reason is FinishReason.STOP:
            assert obeys(so, a.text), (so, a.text)
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            fa, fb = finite(pa), finite(pb)
            assert fa.keys() == fb.keys() and all(abs(fa[t] - fb[t]) < 1e-4 for t in fa)
        forced += walk(llm_k0, p, a.token_ids, a.outputs[0].logprobs)
    assert forced > 0                                     # e.g. EOS once a choice is complete
    plain = llm_k0.generate(PROMPTS, params_for())        # the penalties took effect
    assert any(x.token_ids != y.token_ids for x, y in zip(plain, k0))


def test_n_sequences_each_follow_their_own_grammar(llm_k0, llm_k3):
    params = SamplingParams(n=2, max_tokens=150, temperature=1.0, seed=5, logprobs=2, frequency_penalty=0.3,
                            structured_output=StructuredOutput(json_schema=json.dumps(SCHEMA)))
    for llm in (llm_k0, llm_k3):
        (out,) = llm.generate([PROMPTS[0]], params)
        assert [s.index for s in out.outputs] == [0, 1] and out.outputs[0].token_ids != out.outputs[1].token_ids
        for seq in out.outputs:
            if seq.finish_reason is FinishReason.STOP:
                jsonschema.validate(json.loads(seq.text), SCHEMA)
            else:
                assert seq.finish_reason is FinishReason.LENGTH and len(seq.token_ids) == 150
            assert len(seq.logprobs) == len(seq.token_ids)
            walk(llm, params, seq.token_ids, seq.logprobs)   # a matcher shared by both would have refused
        assert_kv_idle(llm.engine)


def test_logit_bias_steers_within_the_grammar_and_cannot_leave_it(llm_k0):
    def run(**kw):
        out = llm_k0.generate(["My favourite colour is"], SamplingParams(
            max_tokens=8, temperature=0.0, structured_output=StructuredOutput(choice=COLORS), **kw))[0]
        assert out.finish_reason is FinishReason.STOP and out.text in COLORS, out.text
        return out.text

    base = run()
    first = {c: llm_k0.tokenizer.encode(c)[0] for c in COLORS}
    other = next(c for c in COLORS if c != base and list(first.values()).count(first[c]) == 1)
    assert run(logit_bias={first[other]: 60.0}) == other
    outside = llm_k0.tokenizer.encode(" zebra")[0]
    assert outside not in first.values()
    assert run(logit_bias={outside: 100.0}) == base       # a biased token the grammar refuses stays refused


def test_min_tokens_and_bad_words_under_a_grammar(llm_k0):
    yes_no = StructuredOutput(choice=("yes", "no"))

    def run(**kw):
        return llm_k0.generate(["The answer is"], SamplingParams(max_tokens=10, temperature=0.0,
                                                                 structured_output=yes_no, **kw))[0]

    base = run()
    assert base.text in ("yes", "no")
    # after the choice only the stop token may come (here "." instead of EOS, id 0, which an argmax of an
    # all -inf row would pick by accident), and min_tokens bans it: the stop token all the same, at once
    dot = llm_k0.tokenizer.encode(".")[0]
    held = run(min_tokens=6, ignore_eos=True, stop_token_ids=[dot])
    assert held.token_ids == base.token_ids[:-1] + [dot] and held.finish_reason is FinishReason.STOP
    assert len(held.token_ids) < 6
    # a bad word of the first token greedy took: a choice all the same, spelled from other tokens
    word = llm_k0.tokenizer.decode([base.token_ids[0]])
    assert llm_k0.tokenizer.encode(word) == base.token_ids[:1]
    banned = run(bad_words=[word])
    assert banned.text in ("yes", "no") and banned.token_ids[0] != base.token_ids[0], banned.token_ids
    assert_kv_idle(llm_k0.engine)


def test_a_resumed_stream_continues_its_grammar(llm_k0, llm_k3):
    """A stream migrated to another engine (output_token_ids: what was sent) feeds those tokens to its
    new matcher and continues as the unbroken run; tokens the grammar refuses are refused by name."""
    from engine.errors import InvalidArgumentError
    from tests.engine.test_resume import steps_of
    params = params_for(max_tokens=80)[0]                 # the JSON schema, greedy
    for llm in (llm_k0, llm_k3):
        core = llm.engine
        ids = core.tokenizer.encode(PROMPTS[0])
        unbroken = [t for s in steps_of(core, ids, params) for t in s]
        g = len(unbroken) // 2
        resumed = [t for s in steps_of(core, ids, params, output_token_ids=unbroken[:g]) for t in s]
        assert unbroken[:g] + resumed == unbroken
        with pytest.raises(InvalidArgumentError) as e:
            core.add_request(ids, params, output_token_ids=core.tokenizer.encode("hello"))
        assert e.value.field == "output_token_ids" and "structured_output" in str(e.value)
        assert_kv_idle(core)
