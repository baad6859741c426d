"""Per-request statistics: token counts and phase timings, and the rates derived from them exactly as
docs/performance.md defines them:  prefill_tok_s = computed_prefill_tokens / timings.prefill,
decode_tok_s = (completion_tokens - 1) / timings.decode.

An injected clock that advances 0.25 s per target-model forward (a forward hook: the model really runs)
makes every timing an exact, predictable number, so the phase boundaries themselves are checked
(queue ends when the first chunk is scheduled, prefill when the first token is sampled). Runs on the
embedded default model; a real-clock run checks the same identities."""

from __future__ import annotations

import pytest

from tests.conftest import FakeClock, assert_kv_idle, make_llm, run_to_idle, runner_of
from engine import EngineConfig, SamplingParams
from engine.core import EngineCore
from engine.request_stats import FinishReason, RequestStats, Timings

TICK = 0.25


def engine_with_ticking_clock(**cfg) -> tuple[EngineCore, FakeClock]:
    clock = FakeClock(1000.0)
    core = EngineCore(EngineConfig(**{"kv_capacity": 1024, "prefill_chunk": 16, "max_batch": 1, **cfg}), clock=clock)
    runner_of(core).model.register_forward_pre_hook(lambda m, args: clock.advance(TICK) and None)
    return core, clock


def finished_stats(outputs) -> dict[str, dict]:
    return {o.request_id: o.stats for o in outputs if o.finished}


def test_timings_are_the_phase_boundaries():
    core, clock = engine_with_ticking_clock()
    prompt = list(range(10, 50))                                       # 40 tokens: chunks 16, 16, 8
    core.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0), request_id="a")
    core.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0), request_id="b")   # waits: max_batch 1
    clock.advance(2.0)
    stats = finished_stats(run_to_idle(core))
    a, b = stats["a"], stats["b"]
    # a: queued 2 s, 3 prefill chunks, 4 decode steps (the first token comes from the prefill)
    assert a.timings == Timings(queue=2.0, prefill=3 * TICK, decode=4 * TICK, total=2.0 + 7 * TICK,
                                ttft=2.0 + 3 * TICK)
    assert (a.usage.prompt_tokens, a.usage.computed_prefill_tokens, a.usage.cached_tokens, a.usage.completion_tokens) == (40, 40, 0, 5)
    assert a.rates.prefill_tok_s == 40 / (3 * TICK) and a.rates.decode_tok_s == 4 / (4 * TICK)
    assert a.prefill_chunk == 16 and a.preemptions == 0 and a.finish_reason is FinishReason.LENGTH
    # b waited for a to finish, then found a's first two blocks in the prefix cache: one 8-token chunk
    assert (b.usage.cached_tokens, b.usage.computed_prefill_tokens) == (32, 8)
    assert b.timings == Timings(queue=2.0 + 7 * TICK, prefill=TICK, decode=2 * TICK, total=2.0 + 10 * TICK,
                                ttft=2.0 + 8 * TICK)
    assert b.rates.prefill_tok_s == 8 / TICK and b.rates.decode_tok_s == 2 / (2 * TICK)
    assert_kv_idle(core)


def test_speculative_decode_time_counts_rounds():
    core, clock = engine_with_ticking_clock(draft_tokens=2)
    core.add_request(list(range(10, 30)), SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0), request_id="a")
    a = finished_stats(run_to_idle(core))["a"]
    spec = a.speculative
    assert spec.draft_tokens == 2 and spec.drafted == 2 * spec.rounds
    assert a.timings.prefill == 2 * TICK                 # 20 tokens: chunks 16 + 4
    assert a.timings.decode == spec.rounds * TICK     # one verify forward per round
    assert a.rates.decode_tok_s == (a.usage.completion_tokens - 1) / (spec.rounds * TICK)
    assert a.usage.completion_tokens == 12


def test_single_token_request_has_no_decode_rate():
    core, _ = engine_with_ticking_clock()
    core.add_request([5, 6, 7], SamplingParams(max_tokens=1, temperature=0.0), request_id="a")
    a = finished_stats(run_to_idle(core))["a"]
    assert a.usage.completion_tokens == 1 and a.timings.decode == 0.0 and a.rates.decode_tok_s == 0.0
    assert a.timings.prefill == TICK and a.rates.prefill_tok_s == 3 / TICK


def test_aborted_in_queue_spent_its_time_queued():
    core, clock = engine_with_ticking_clock()
    core.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0), request_id="a")
    clock.advance(1.5)
    out = core.abort("a")
    t = out.stats.timings
    assert out.finish_reason == "abort"
    assert t == Timings(queue=1.5, prefill=0.0, decode=0.0, total=1.5, ttft=0.0)
    assert out.stats.usage.completion_tokens == 0 and out.stats.rates.prefill_tok_s == 0.0
    assert_kv_idle(core)


def check_identities(stats: RequestStats) -> None:
    t = stats.timings
    assert all(v >= 0 for v in (t.queue, t.prefill, t.decode, t.total, t.ttft))
    assert t.ttft == pytest.approx(t.queue + t.prefill, abs=1e-9)
    assert t.total >= t.ttft + t.decode - 1e-9
    if stats.usage.computed_prefill_tokens and t.prefill > 0:
        assert stats.rates.prefill_tok_s == stats.usage.computed_prefill_tokens / t.prefill
    if stats.usage.completion_tokens > 1 and t.decode > 0:
        assert stats.rates.decode_tok_s == (stats.usage.completion_tokens - 1) / t.decode
    assert stats.usage.prompt_tokens == stats.usage.computed_prefill_tokens + stats.usage.cached_tokens


def test_real_clock_stats_satisfy_the_definitions():
    llm = make_llm(None, kv_capacity=2048, prefill_chunk=32, draft_tokens=2)
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 70)] + [list(range(3, 43))]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0) for m in (1, 9, 17, 6)])
    for out, prompt in zip(outs, prompts):
        check_identities(out.stats)
        assert out.stats.usage.prompt_tokens == len(prompt) and out.stats.usage.completion_tokens == len(out.token_ids)
        assert out.stats.timings.total == pytest.approx(
            out.stats.timings.ttft + out.stats.timings.decode, abs=1e-9)
    assert outs[1].stats.rates.prefill_tok_s > 0 and outs[1].stats.rates.decode_tok_s > 0
