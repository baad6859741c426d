"""KV runs out mid-decode: the newest running request is preempted and later recomputed from prompt +
outputs (engine/sched/scheduler.py). With a KV pool far smaller than the batch needs, every request still
finishes with exactly the tokens it produces alone -- greedy with and without MTP speculation (whose
MTP cache is rebuilt by the recompute), and seeded sampling without speculation (counter-based RNG)
-- some stats report preemptions, and at the end every block is free.

Seeded sampling *with* speculation is reproducible only up to a preemption: the recompute samples the
next token directly where the uninterrupted run had a draft/verify round, so the continuation is
another sample from the same distribution (rounds re-align), not the same one."""

from __future__ import annotations

import pytest

from tests.conftest import WORKLOADS, assert_kv_idle, make_llm
from engine import SamplingParams

PROMPTS = [WORKLOADS["code"][1], WORKLOADS["json"][1], WORKLOADS["prose"][0], WORKLOADS["enumeration"][1]]
PARAMS = [SamplingParams(max_tokens=110, ignore_eos=True, temperature=0.0),
          SamplingParams(max_tokens=100, ignore_eos=True, temperature=0.8, seed=11),
          SamplingParams(max_tokens=120, ignore_eos=True, temperature=1.0, top_k=20, seed=12),
          SamplingParams(max_tokens=90, ignore_eos=True, temperature=0.0)]
KV_TOKENS = 320          # 20 blocks; each request needs 8-10 at the end, the four together ~37


@pytest.fixture(scope="module")
def alone(shared_model):
    outs = {}
    for k in (0, 2):
        llm = make_llm(shared_model, draft_tokens=k)
        outs[k] = [llm.generate([p], sp)[0].token_ids for p, sp in zip(PROMPTS, PARAMS)]
    return outs


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("prefix_reuse", [True, False])
def test_preempted_requests_finish_as_if_alone(shared_model, alone, k, prefix_reuse):
    llm = make_llm(shared_model, draft_tokens=k, kv_capacity=KV_TOKENS, prefix_reuse=prefix_reuse)
    core = llm.engine
    for p, sp in zip(PROMPTS, PARAMS):
        assert len(llm.tokenizer.encode(p)) + sp.max_tokens + k <= KV_TOKENS      # each fits alone
    reqs = [core.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    first_preempted_at: dict[int, int] = {}                 # request -> outputs it had when first preempted
    finished = {}
    while core.has_work:
        for out in core.step():
            if out.finished:
                finished[out.request_id] = out
        for i, r in enumerate(reqs):
            if r.num_preemptions and i not in first_preempted_at:
                first_preempted_at[i] = len(r.output_token_ids)
    preemptions = [finished[r.request_id].stats.preemptions for r in reqs]
    print(f"\nk={k} prefix_reuse={prefix_reuse}: preemptions per request {preemptions}, "
          f"first at output {first_preempted_at}")
    assert sum(preemptions) > 0 and preemptions == [r.num_preemptions for r in reqs]
    for i, (r, want, sp) in enumerate(zip(reqs, alone[k], PARAMS)):
        got = r.output_token_ids
        assert len(got) == sp.max_tokens and r.finish_reason.value == "length"
        if sp.greedy or k == 0 or i not in first_preempted_at:
            assert got == want, f"request {i} (preempted {preemptions[i]}x) diverged"
        else:
            n = first_preempted_at[i]
            assert got[:n] == want[:n], f"request {i} diverged before its preemption"
        stats = finished[r.request_id].stats
        # the first prefill is what the request computed; recomputes do not inflate it
        assert stats.usage.computed_prefill_tokens + stats.usage.cached_tokens == stats.usage.prompt_tokens
    assert any(PARAMS[i].greedy for i in first_preempted_at)          # a greedy request was preempted
    assert_kv_idle(core)
    # the engine is healthy afterwards: a new request runs and matches its solo output
    again = llm.generate([PROMPTS[0]], PARAMS[0])[0]
    assert again.token_ids == alone[k][0]
    assert_kv_idle(core)
