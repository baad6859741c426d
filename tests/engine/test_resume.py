"""A stream resumed on another engine continues exactly (issue 39, item 2; the engine half of
migration). A request given the tokens it already generated (`output_token_ids`) prefills prompt +
those but the last, samples nothing, and decodes on with the same seed and output counters: at any
round boundary of the unbroken run (what a gateway has sent: whole engine steps), greedy and seeded
continuations equal the unbroken run token for token, with MTP k = 3 as with k = 0."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.conftest import WORKLOADS, assert_kv_idle, make_llm

PROMPTS = [WORKLOADS["prose"][0], WORKLOADS["json"][1]]
MAX_TOKENS = 24


def steps_of(core, prompt_ids: list[int], params: SamplingParams, output_token_ids=None) -> list[list[int]]:
    """The tokens of one request, step by step (one list per engine step that produced tokens)."""
    req = core.add_request(prompt_ids, params, output_token_ids=output_token_ids)
    steps = []
    while not req.finished:
        for out in core.step():
            if out.request_id == req.request_id and out.new_token_ids:
                steps.append(list(out.new_token_ids))
    assert_kv_idle(core)
    return steps


@pytest.fixture(scope="module", params=[0, 3], ids=["k0", "k3"])
def core(request, shared_model):
    return make_llm(shared_model, draft_tokens=request.param).engine


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.95, seed=1234)],
                         ids=["greedy", "seeded"])
def test_a_resumed_request_continues_the_unbroken_run_at_every_step_boundary(core, sampling):
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
    for prompt in PROMPTS:
        ids = core.tokenizer.encode(prompt)
        unbroken = steps_of(core, ids, params)
        flat = [t for s in unbroken for t in s]
        assert len(flat) == MAX_TOKENS
        boundaries = [sum(len(s) for s in unbroken[:i]) for i in range(1, len(unbroken))]
        for g in boundaries[1::max(1, len(boundaries) // 2)]:         # seams early and late in the stream
            resumed = steps_of(core, ids, params, output_token_ids=flat[:g])
            assert [t for s in resumed for t in s] == flat[g:], f"seam at {g} of {prompt[:20]!r}"


def test_a_resumed_request_counts_every_token_and_refuses_a_finished_one(core):
    ids = core.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    req = core.add_request(ids, params, output_token_ids=[5, 6, 7])
    while not req.finished:
        core.step()
    stats = req.stats(core.config.prefill_chunk)
    assert stats.usage.completion_tokens == 10 and stats.usage.prompt_tokens == len(ids)
    assert req.output_token_ids[:3] == [5, 6, 7]
    from engine.errors import InvalidArgumentError
    with pytest.raises(InvalidArgumentError, match="output_token_ids"):
        core.add_request(ids, params, output_token_ids=list(range(10)))
    assert_kv_idle(core)


def test_a_stop_string_that_spans_the_seam_ends_the_resumed_request_where_the_unbroken_one_ends(core):
    ids = core.tokenizer.encode(PROMPTS[1])
    plain = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)   # (vLLM's default samples)
    unbroken = steps_of(core, ids, plain)
    flat = [t for s in unbroken for t in s]
    g = sum(len(s) for s in unbroken[:len(unbroken) // 2])              # a step boundary mid-stream
    before, after = core.tokenizer.decode(flat[:g]), core.tokenizer.decode(flat[:g + 2])
    tail = after[len(before):]
    assert tail, "two tokens past the seam make text"
    for k in range(3, len(before)):                                    # text on both sides of the seam,
        stop = before[-k:] + tail                                      # first found there
        if after.find(stop) == len(before) - k:
            break
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0, stop=[stop])
    whole = [t for s in steps_of(core, ids, params) for t in s]
    resumed = [t for s in steps_of(core, ids, params, output_token_ids=flat[:g]) for t in s]
    assert flat[:g] + resumed == whole and len(whole) < MAX_TOKENS, "the stop string is found across the seam"
