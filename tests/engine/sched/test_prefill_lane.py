"""The packed prefill lane (engine.sched.prefill_lane): prompts that wait together share a step's chunk.

Checked: the scheduler's FIFO budget split and the step count of 8 simultaneous prompts; on real
engines (the embedded model and the shared trained one, k = 0 and k = 3, TP = 1 and 2 on the CPU)
greedy tokens equal to each prompt prefilled alone, every KV block freed once, each request's own
timings (queue + prefill = TTFT, admission and first token at the steps that did them) and token
counts, prefix reuse inside and across packed steps, and parked requests (the split path)."""

from __future__ import annotations

import pytest

from tests.conftest import FakeClock, assert_kv_idle, make_llm, make_request, make_scheduler, model_step, run_to_idle
from engine import SamplingParams
from engine.sched.request import RequestStatus


def steps_to_first_tokens(chunk: int, prompts: int = 8, length: int = 512) -> tuple[int, list[str]]:
    """Steps until every one of `prompts` simultaneous prompts has its first token, and their order."""
    sched = make_scheduler(num_blocks=400, block_size=16, prefill_chunk=chunk, max_batch=16)
    reqs = [make_request(prompt=length, max_tokens=2) for _ in range(prompts)]
    for r in reqs:
        sched.add_request(r)
    order, steps = [], 0
    while len(order) < prompts:
        steps += 1
        out = sched.schedule()
        assert sum(len(p.token_ids) for p in out.prefills) <= chunk
        order += [ev.request.request_id for ev in model_step(sched, out) if len(ev.request.output_token_ids) == 1]
    return steps, order, reqs


def test_eight_simultaneous_prompts_get_first_tokens_in_fewer_steps():
    """8 x 512 tokens with a 2048-token chunk: two steps (4 prompts each) instead of one per prompt."""
    steps, order, reqs = steps_to_first_tokens(2048)
    assert steps == 2 and order == [r.request_id for r in reqs]               # FIFO kept
    # a budget of one prompt per step is the old lane: eight steps
    assert steps_to_first_tokens(512)[0] == 8


def test_a_prompt_spanning_chunks_continues_before_those_behind_it():
    sched = make_scheduler(prefill_chunk=32, block_size=16)
    a, b, c = make_request(prompt=50), make_request(prompt=20), make_request(prompt=5)
    for r in (a, b, c):
        sched.add_request(r)
    pieces = []
    while sched.has_work and len(pieces) < 3:
        out = sched.schedule()
        pieces.append([(p.request_id, p.start, len(p.token_ids)) for p in out.prefills])
        model_step(sched, out)
    assert pieces[0] == [(a.request_id, 0, 32)]
    assert pieces[1] == [(a.request_id, 32, 18), (b.request_id, 0, 14)]
    assert pieces[2] == [(b.request_id, 14, 6), (c.request_id, 0, 5)]


def test_packing_respects_batch_seats():
    sched = make_scheduler(prefill_chunk=1024, max_batch=3)
    reqs = [make_request(prompt=10, max_tokens=50) for _ in range(5)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert [p.request_id for p in out.prefills] == [r.request_id for r in reqs[:3]]
    model_step(sched, out)
    assert len(sched.running) == 3 and list(sched.waiting) == reqs[3:]


# -- real engines ------------------------------------------------------------------------------------

def prompt_ids(n: int, seed: int) -> list[int]:
    return [(i * 37 + seed * 101) % 300 + 5 for i in range(n)]


PROMPTS = [prompt_ids(n, s) for s, n in enumerate((45, 9, 70, 30, 17, 52))]


def alone_and_packed(model, k: int, **engine_args) -> tuple[list, list, object]:
    """Greedy tokens of each prompt run alone, then of all prompts added together (packed)."""
    llm = make_llm(model, draft_tokens=k, prefill_chunk=64, prefix_reuse=False, **engine_args)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    alone = [llm.generate(p, params)[0].token_ids for p in PROMPTS]
    core = llm.engine
    clock = FakeClock(0.0)
    core.clock = core.scheduler.clock = core.scheduler.lane.clock = clock
    reqs = [core.add_request(p, params) for p in PROMPTS]
    while core.has_work:
        clock.advance(1.0)                                 # step s runs at time s
        core.step()
    return alone, reqs, core


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("model", ["embedded", "shared"])
def test_packed_greedy_tokens_equal_prompts_prefilled_alone(model, k, request):
    path = None if model == "embedded" else request.getfixturevalue("shared_model")
    alone, reqs, core = alone_and_packed(path, k)
    assert [r.output_token_ids for r in reqs] == alone
    assert_kv_idle(core)
    for r in reqs:                                         # each request's own figures
        s = r.stats(64)
        t = s.timings
        assert t.ttft == pytest.approx(t.queue + t.prefill, abs=1e-9)
        assert s.usage.computed_prefill_tokens + s.usage.cached_tokens == len(r.prompt_token_ids)
        # the prompts form one stream of tokens cut into chunks of 64: a request is admitted in the
        # step of its first token's chunk and gets its first token in the step of its last one's
        first = sum(len(p) for p in PROMPTS[:reqs.index(r)])
        last = first + len(r.prompt_token_ids) - 1
        assert t.queue == pytest.approx(first // 64 + 1)
        assert t.prefill == pytest.approx(last // 64 - first // 64)


@pytest.mark.parametrize("k", [0, 3])
def test_packed_hybrid_prompts_equal_prompts_prefilled_alone(k):
    """Qwen3.5-class hybrid: each piece of a packed chunk runs its linear-attention layers from its
    own state slot (conv window and recurrent state), pieces of unequal and of equal length alike."""
    from tests.support.hybrid import require_shared_hybrid
    alone, reqs, core = alone_and_packed(require_shared_hybrid(), k)
    assert [r.output_token_ids for r in reqs] == alone
    for r in reqs:          # packed: each admitted in the step of its first token's chunk of 64, as above
        first = sum(len(p) for p in PROMPTS[:reqs.index(r)])
        assert r.stats(64).timings.queue == pytest.approx(first // 64 + 1)
    assert_kv_idle(core)
    states = core.scheduler.states
    assert states.num_free == states.num_slots and states.taken == states.dropped


def test_packed_prefill_on_two_cpu_ranks_equals_prompts_alone(shared_model):
    alone, reqs, core = alone_and_packed(shared_model, 3, tensor_parallel_size=2)
    assert [r.output_token_ids for r in reqs] == alone
    assert_kv_idle(core)
    core.shutdown()


def test_a_duplicate_sent_together_waits_for_the_cached_prefix(shared_model):
    """Two equal prompts sent together: the second does not join the first's chunk (it would compute
    the same blocks) but waits one step and takes them from the prefix cache; a third, later, too.
    Tokens equal to the prompt alone; a prompt with another prefix is not held back."""
    llm = make_llm(shared_model, draft_tokens=3, prefill_chunk=256)
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    p = prompt_ids(100, 9)
    want = llm.generate(p, params)[0].token_ids
    llm.engine.kv.reset_prefix_cache()
    core = llm.engine
    a, b = core.add_request(p, params), core.add_request(p, params)
    core.step()
    assert core.scheduler.lane.requests == [] and b.status is RequestStatus.WAITING   # a done in one chunk
    other = core.add_request(prompt_ids(60, 4), params)
    core.step()
    assert b.num_cached_tokens == 96 and b.computed_prefill_tokens == 4
    assert other.num_cached_tokens == 0 and other.status is not RequestStatus.WAITING   # packed beside b
    c = core.add_request(p, params)
    run_to_idle(core)
    assert c.num_cached_tokens == 96 and c.computed_prefill_tokens == 4
    assert a.output_token_ids == b.output_token_ids == c.output_token_ids == want
    assert_kv_idle(core)


def test_packed_requests_park_and_resume(shared_model):
    llm = make_llm(shared_model, draft_tokens=3, prefill_chunk=64, prefix_reuse=False)
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)
    want = [llm.generate(p, params)[0].token_ids for p in PROMPTS[:4]]
    core = llm.engine
    reqs = [core.add_request(p, params, park_after_prefill=True) for p in PROMPTS[:4]]
    run_to_idle(core)
    assert all(r.status is RequestStatus.PARKED and len(r.output_token_ids) == 1 for r in reqs)
    for r in reqs:
        core.resume(r.request_id)
    run_to_idle(core)
    assert [r.output_token_ids for r in reqs] == want
    assert_kv_idle(core)
