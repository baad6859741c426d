"""n > 1: n sequences from one prompt, one prefill, the prompt's KV blocks shared by reference count,
each sequence with its own seed stream (equal to an n = 1 request with that seed), its own index;
an abort frees every sequence exactly once; a fork that finds no KV queues and prefills alone;
the prefill/decode split parks and resumes all n."""

from __future__ import annotations

import pytest

from engine import InvalidArgumentError, SamplingParams
from engine.core import sequence_seed
from engine.loop import EngineLoop
from engine.sched.request import RequestStatus
from tests.conftest import assert_kv_idle, make_llm, run_to_idle

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"      # 20 tokens: a partial last block
N = 4


def test_each_sequence_is_the_n1_request_with_its_own_seed(llm_k0):
    params = SamplingParams(n=N, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True, logprobs=2)
    out = llm_k0.generate([PROMPT], params)[0]
    assert [o.index for o in out.outputs] == list(range(N))
    assert len({tuple(o.token_ids) for o in out.outputs}) == N                      # distinct samples
    alone = llm_k0.generate([PROMPT] * N, [SamplingParams(**{**vars(params), "n": 1, "seed": sequence_seed(7, i)})
                                          for i in range(N)])
    assert [o.outputs[0].token_ids for o in alone] == [o.token_ids for o in out.outputs]
    assert out.token_ids == out.outputs[0].token_ids                              # ninfer's flat fields: sequence 0
    assert all(len(o.logprobs) == len(o.token_ids) for o in out.outputs)
    # one prefill: sequence 0 computed the prompt, the others none of it
    assert [o.stats.usage.computed_prefill_tokens for o in out.outputs] == [len(out.prompt_token_ids), 0, 0, 0]
    again = llm_k0.generate([PROMPT], params)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]   # seeded: replays
    assert_kv_idle(llm_k0.engine)


def test_the_sequences_share_the_prompts_blocks_and_an_abort_frees_all_once(llm_k3):
    core = llm_k3.engine
    req = core.add_request(PROMPT, SamplingParams(n=N, max_tokens=200, temperature=1.0, seed=1, ignore_eos=True))
    members = [req, *req.forks]
    while not all(m.status is RequestStatus.RUNNING for m in members):
        core.step()
    bs = core.kv.block_size
    prompt = len(req.prompt_token_ids)
    assert prompt % bs and prompt > bs                                       # full blocks and a partial one
    shared = req.block_ids[:prompt // bs]
    for m in members:
        assert m.block_ids[:prompt // bs] == shared                          # the full prompt blocks, shared
        assert m.block_ids[prompt // bs] not in [b for o in members if o is not m for b in o.block_ids]
    assert all(core.kv.ref_count(b) == N for b in shared)
    assert sum(m.computed_prefill_tokens for m in members) == prompt        # one prefill
    outs = core.abort_all(req.request_id)
    assert sorted(o.index for o in outs) == list(range(N)) and all(o.finished for o in outs)
    run_to_idle(core)
    assert_kv_idle(core)                                                     # every reference dropped once


def test_greedy_sequences_are_identical_and_speculation_equals_k0(llm_k0, llm_k3):
    params = SamplingParams(n=3, max_tokens=20, temperature=0.0, ignore_eos=True, repetition_penalty=1.2)
    want = llm_k0.generate([PROMPT], SamplingParams(**{**vars(params), "n": 1}))[0].token_ids
    for llm in (llm_k0, llm_k3):
        out = llm.generate([PROMPT], params)[0]
        assert [o.token_ids for o in out.outputs] == [want] * 3
        assert_kv_idle(llm.engine)


def test_a_fork_that_finds_no_kv_prefills_alone_and_samples_the_same(shared_model):
    params = SamplingParams(n=3, max_tokens=40, temperature=1.0, seed=11, ignore_eos=True)
    roomy = make_llm(shared_model)
    want = [o.token_ids for o in roomy.generate([PROMPT], params)[0].outputs]
    # 16 blocks; a request ahead holds 13 of them when the prompt forks: one sequence forks, two queue
    tight = make_llm(shared_model, kv_capacity=256, max_batch=4)
    busy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    _, got = tight.generate([list(range(5, 205)), PROMPT], [busy, params])
    assert [o.token_ids for o in got.outputs] == want
    assert sum(o.stats.usage.computed_prefill_tokens for o in got.outputs) > len(got.prompt_token_ids)
    assert_kv_idle(tight.engine)


def test_the_split_parks_and_resumes_every_sequence(shared_model):
    loop = EngineLoop(make_llm(shared_model, draft_tokens=2).engine).start()
    try:
        params = SamplingParams(n=N, max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
        stream = loop.submit(PROMPT, params, request_id="split", park_after_prefill=True)
        first = [stream.next(timeout=60) for _ in range(N)]
        assert sorted(o.index for o in first) == list(range(N))
        assert all(len(o.new_token_ids) == 1 and not o.finished for o in first)
        assert loop.call(lambda core: sum(core.scheduler.is_parked(r) for r in core._groups["split"])) == N
        resumed = loop.resume("split")
        assert resumed is stream
        tokens = {o.index: list(o.new_token_ids) for o in first}
        for out in stream:
            tokens[out.index] += out.new_token_ids
        assert all(len(t) == 10 for t in tokens.values())
        want = make_llm(shared_model, draft_tokens=2).generate([PROMPT], params)[0]
        assert [tokens[i] for i in range(N)] == [o.token_ids for o in want.outputs]
        # a released handle frees every parked sequence
        loop.submit(PROMPT, params, request_id="dropped", park_after_prefill=True)
        loop.release("dropped")
        assert loop.call(lambda core: core.scheduler.num_unfinished) == 0
        loop.call(assert_kv_idle)
    finally:
        loop.shutdown()


@pytest.mark.parametrize("params, field, fragment", [
    (dict(n=65), "n", "exceed the decode batch of 64"),
    (dict(n=8, max_tokens=1500), "n", "exceed the KV capacity of 8192 tokens"),
    (dict(n=129), "n", "[1, 128]"),
])
def test_n_beyond_the_batch_or_the_kv_is_refused_naming_n(llm_k0, params, field, fragment):
    core = llm_k0.engine
    with pytest.raises(InvalidArgumentError) as e:
        core.add_request(PROMPT, SamplingParams(**params))
    assert e.value.field == field and fragment in str(e.value), str(e.value)
    assert_kv_idle(core)
