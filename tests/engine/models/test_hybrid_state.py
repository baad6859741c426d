"""Linear-attention state beside the paged KV (hybrid models).

- The slot pool (pure Python) hands out and takes back slots exactly once; the scheduler holds one
  per request from admission to finish or preemption, and a request waits for a slot like for KV;
  prompts that fit one chunk pack as far as slots allow.
- The memory plan counts the slots; a refusal names KV and state slots both.
- Chunked prefill carries the state across chunks: any chunk >= 16 gives the one-pass tokens.
- Preemption recomputes the state: preempted requests finish with their solo tokens.
- int8 KV applies to the full-attention layers only; the recurrent states stay float32.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import WORKLOADS, assert_kv_idle, make_llm, make_request, make_scheduler, runner_of
from engine import SamplingParams
from engine.worker.memory_plan import plan_memory
from engine.config import EngineConfig
from engine.errors import CapacityError
from engine.loading.hybrid_config import linear_state_bytes
from engine.loading.checkpoint import read_model_dir
from engine.sched.scheduler import ModelOutput
from engine.cache.state_slots import StateSlotPool
from tests.support.hybrid import require_shared_hybrid


def assert_states_idle(core) -> None:
    pool = core.states
    assert pool.num_free == pool.num_slots, f"{pool.num_slots - pool.num_free} state slots still held"
    assert pool.taken == pool.dropped, f"slots taken {pool.taken} != dropped {pool.dropped}"


# -- the pool and the scheduler (no model) -------------------------------------------------------------

def test_pool_hands_out_each_slot_once():
    pool = StateSlotPool(2)
    a, b, c = make_request(), make_request(), make_request()
    assert pool.allocate(a) and pool.allocate(b) and not pool.allocate(c)
    assert {a.state_slot, b.state_slot} == {0, 1} and c.state_slot == -1
    pool.free(a)
    pool.free(a)                                        # idempotent per request
    assert pool.num_free == 1 and a.state_slot == -1
    assert pool.allocate(c) and c.state_slot == 0
    with pytest.raises(RuntimeError, match="already holds state slot"):
        pool.allocate(c)
    b.state_slot = 0                                    # a forged slot: not b's to free
    with pytest.raises(RuntimeError, match="freed twice or by a request that does not own it"):
        pool.free(b)


def test_scheduler_holds_a_slot_per_request_and_frees_it_once():
    sched = make_scheduler(num_blocks=64, max_batch=8)
    sched.states = StateSlotPool(2)
    reqs = [make_request(prompt=20, max_tokens=3) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    seen_waiting_for_slot = packed = False
    while sched.has_work:
        out = sched.schedule()
        if sched.waiting and sched.states.num_free == 0 and sched.kv.num_free_blocks > 8:
            seen_waiting_for_slot = True                # KV was free: the slot held it back
        held = [r for r in reqs if r.state_slot >= 0]
        assert len({r.state_slot for r in held}) == len(held) <= 2
        assert len(out.prefills) <= 2                   # two slots: at most two prompts in a chunk
        packed |= len(out.prefills) == 2
        for w in out.decode + out.prefills:
            assert w.state_slot == sched.requests[w.request_id].state_slot >= 0
        result = ModelOutput({w.request_id: [7] for w in out.decode + [p for p in out.prefills if p.sample]})
        sched.update(out, result)
    assert seen_waiting_for_slot and packed
    assert all(r.state_slot == -1 and r.finished for r in reqs)
    assert sched.states.taken == sched.states.dropped == 3 and sched.states.num_free == 2


def test_preemption_frees_the_slot():
    sched = make_scheduler(num_blocks=3, block_size=16, max_batch=4, prefill_chunk=64)
    sched.states = StateSlotPool(4)
    a, b = make_request(prompt=15, max_tokens=30), make_request(prompt=15, max_tokens=30)
    sched.add_request(a)
    sched.add_request(b)
    preempted = False
    for _ in range(200):
        if not sched.has_work:
            break
        out = sched.schedule()
        if b.num_preemptions or a.num_preemptions:
            preempted = True
            victim = b if b.num_preemptions else a
            assert victim.state_slot == -1 or victim.status.value != "waiting"
        result = ModelOutput({w.request_id: [5] for w in out.decode + [p for p in out.prefills if p.sample]})
        sched.update(out, result)
    assert preempted and not sched.has_work
    assert sched.states.taken == sched.states.dropped and sched.states.num_free == 4


# -- memory plan ----------------------------------------------------------------------------------------

def test_plan_counts_state_slots_and_refusal_names_both():
    cfg = read_model_dir(require_shared_hybrid()).config
    per_request = linear_state_bytes(cfg)
    # 6 linear layers x (conv window 3 x (48*4*2 + 48*8) channels + 8 heads x 48 x 48) x 4 bytes
    assert per_request == 6 * (3 * 768 + 8 * 48 * 48) * 4 == 497_664
    plan = plan_memory(EngineConfig(model="x", max_batch=16, kv_capacity=1024), cfg, 0, 4096)
    assert plan.state_slots == 16 + 16 and plan.state_bytes == 33 * per_request          # seats + snapshots
    no_reuse = plan_memory(EngineConfig(model="x", max_batch=16, kv_capacity=1024, prefix_reuse=False), cfg, 0, 4096)
    assert no_reuse.state_slots == 16 and no_reuse.state_bytes == 17 * per_request
    assert plan.kv_bytes_per_token == 2 * 2 * 2 * 64 * 4       # 2 full layers only, 2 KV heads, float32
    with pytest.raises(CapacityError) as e:
        plan_memory(EngineConfig(model="x", max_batch=64, kv_capacity=1 << 20), cfg, 0, 4096,
                    available=200 << 20)
    assert "KV 1048576 tokens" in str(e.value)
    assert "state slots 80 (seats and snapshots, +1 scratch) x 497664 B" in str(e.value)


# -- the engine on the shared hybrid ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def hybrid():
    return require_shared_hybrid()


@pytest.fixture(scope="module")
def solo(hybrid):
    llm = make_llm(hybrid, prefill_chunk=2048)
    ids = llm.tokenizer.encode("\n".join(WORKLOADS["code"] + WORKLOADS["json"]))[:150]
    return ids, llm.generate([ids], SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0))[0].token_ids


@pytest.mark.parametrize("chunk", [16, 17, 33, 64, 100])
def test_any_chunk_gives_the_one_pass_tokens(hybrid, solo, chunk):
    ids, want = solo
    llm = make_llm(hybrid, prefill_chunk=chunk)
    out = llm.generate([ids], SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0))[0]
    assert out.token_ids == want
    assert_states_idle(llm.engine)


def test_states_are_freed_after_aborts_and_batches(hybrid):
    llm = make_llm(hybrid, max_batch=4)
    core = llm.engine
    reqs = [core.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0)) for p in WORKLOADS["prose"]]
    core.add_request(WORKLOADS["code"][0], SamplingParams(max_tokens=20, temperature=0.0), request_id="queued")
    core.step()
    core.step()
    core.abort(reqs[0].request_id)                      # mid-prefill or decode
    core.abort("queued")                                # never admitted: holds no slot
    while core.has_work:
        core.step()
    assert_kv_idle(core)
    assert_states_idle(core)


def test_preempted_requests_finish_as_if_alone(hybrid):
    prompts = [WORKLOADS["code"][1], WORKLOADS["json"][1], WORKLOADS["prose"][0], WORKLOADS["enumeration"][1]]
    params = SamplingParams(max_tokens=90, ignore_eos=True, temperature=0.0)
    alone = make_llm(hybrid)
    want = [alone.generate([p], params)[0].token_ids for p in prompts]
    for k in (0, 2):
        llm = make_llm(hybrid, kv_capacity=320, draft_tokens=k)
        outs = llm.generate(prompts, params)
        assert sum(o.stats.preemptions for o in outs) > 0
        assert [o.token_ids for o in outs] == want, f"k={k}"
        assert_kv_idle(llm.engine)
        assert_states_idle(llm.engine)


def test_int8_kv_is_for_full_attention_layers_only(hybrid):
    llm = make_llm(hybrid, kv_dtype="int8", draft_tokens=2)
    runner = runner_of(llm.engine)
    assert len(runner.kv) == 2 + 1 and all(kv.quantized for kv in runner.kv)      # 2 full layers + MTP
    assert len(runner.states.layers) == 6
    assert all(s.ssm.dtype == torch.float32 for s in runner.states.layers)
    out = llm.generate([WORKLOADS["json"][0]], SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0))[0]
    exact = make_llm(hybrid).generate([WORKLOADS["json"][0]], SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0))[0]
    # int8 KV is lossy: the first tokens agree with float32 KV on this prompt
    assert out.token_ids[:4] == exact.token_ids[:4]
