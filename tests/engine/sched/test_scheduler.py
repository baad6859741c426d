"""The scheduler: FIFO admission through one prefill lane, the pending queue's limit and timeout,
admission refusals at the door, and aborts in every state -- after each of which, at idle, every KV
block is free and every block reference taken was dropped once.

The first half drives the real Scheduler and KVCacheManager with factory requests (the model's
tokens are supplied by the test: the scheduler never sees tensors); the second half drives a real
EngineCore on the embedded default model with an injected clock."""

from __future__ import annotations

import pytest

from tests.conftest import FakeClock, assert_kv_idle, make_request, make_scheduler, model_step, run_to_idle, runner_of
from engine import EngineConfig, InvalidArgumentError, QueueFullError, SamplingParams
from engine.core import EngineCore
from engine.sched.request import FinishReason, RequestStatus


def step(sched) -> list:
    sched.expire()
    return model_step(sched, sched.schedule())


def kv_idle(sched) -> bool:
    return sched.kv.num_free_blocks == sched.kv.num_blocks and sched.kv.refs_taken == sched.kv.refs_dropped


# -- FIFO -------------------------------------------------------------------------------------------

def test_requests_enter_the_lane_in_arrival_order():
    sched = make_scheduler(prefill_chunk=16)
    reqs = [make_request(prompt=n, max_tokens=3) for n in (40, 5, 17, 1, 33)]
    for r in reqs:
        sched.add_request(r)
    lane_order = []
    while sched.has_work:
        out = sched.schedule()
        for piece in out.prefills:
            if not lane_order or lane_order[-1] != piece.request_id:
                lane_order.append(piece.request_id)
            assert piece.token_ids
        assert sum(len(p.token_ids) for p in out.prefills) <= 16
        model_step(sched, out)
    assert lane_order == [r.request_id for r in reqs]
    assert all(r.finish_reason is FinishReason.LENGTH and len(r.output_token_ids) == 3 for r in reqs)
    assert kv_idle(sched)


def test_head_of_queue_is_not_overtaken_while_it_waits_for_blocks():
    clock = FakeClock(0.0)
    sched = make_scheduler(num_blocks=8, block_size=16, prefill_chunk=256, clock=clock)
    big = make_request(prompt=90, max_tokens=30)           # 6 blocks, runs
    head = make_request(prompt=60, max_tokens=4)           # 4 blocks: waits for big
    small = make_request(prompt=5, max_tokens=2)           # 1 block: would fit, must wait behind head
    for r in (big, head, small):
        sched.add_request(r)
    step(sched)                                            # big prefills and starts decoding
    for _ in range(5):
        clock.advance(1.0)
        step(sched)
        assert head.status is RequestStatus.WAITING and small.status is RequestStatus.WAITING
        assert list(sched.waiting) == [head, small]
    while sched.has_work:
        clock.advance(1.0)
        step(sched)
    # once big's blocks free, head and small share one packed chunk (head first): never small alone
    assert head.times.prefill_start <= small.times.prefill_start
    assert kv_idle(sched)


# -- the queue's limit and timeout -------------------------------------------------------------------

def test_queue_full_is_refused_at_once():
    sched = make_scheduler(max_pending=2, prefill_chunk=8)    # a's 8 tokens fill a chunk: b stays queued
    a, b = make_request(), make_request()
    sched.add_request(a)
    sched.add_request(b)
    c = make_request()
    with pytest.raises(QueueFullError, match=r"pending queue is full \(2 requests\)"):
        sched.add_request(c)
    assert c.request_id not in sched.requests and list(sched.waiting) == [a, b]
    sched.schedule()                                       # a moves into the lane: room again
    sched.add_request(c)
    assert list(sched.waiting) == [b, c]


def test_pending_timeout_finishes_queued_requests_only():
    clock = FakeClock(0.0)
    sched = make_scheduler(clock=clock, max_batch=1, pending_timeout_s=1.0)
    runner, queued = make_request(max_tokens=50, arrival=0.0), make_request(arrival=0.0)
    sched.add_request(runner)
    sched.add_request(queued)
    step(sched)
    clock.advance(0.9)
    assert sched.expire() == []
    clock.advance(0.2)
    assert sched.expire() == [queued]
    assert queued.finish_reason is FinishReason.QUEUE_TIMEOUT and not queued.block_ids
    assert runner.status is RequestStatus.RUNNING
    while sched.has_work:
        step(sched)
    assert runner.finish_reason is FinishReason.LENGTH and kv_idle(sched)


def test_a_preempted_request_is_not_timed_out_as_if_queued():
    """Preemption sends a running request back to the queue; it was admitted long ago, and its
    stream must see only a pause (scheduler docstring), not a queue timeout."""
    clock = FakeClock(0.0)
    sched = make_scheduler(clock=clock, num_blocks=6, block_size=16, pending_timeout_s=1.0)
    a, b = make_request(prompt=30, max_tokens=60, arrival=0.0), make_request(prompt=30, max_tokens=60, arrival=0.0)
    sched.add_request(a)
    sched.add_request(b)
    preempted_at = None
    while sched.has_work:
        clock.advance(0.1)                                 # every step takes 0.1 s: 5 s in all
        step(sched)
        if preempted_at is None and b.num_preemptions:
            preempted_at = clock.t
    assert preempted_at is not None and preempted_at > 1.0       # preempted after the pending timeout
    assert a.finish_reason is FinishReason.LENGTH and b.finish_reason is FinishReason.LENGTH
    assert len(b.output_token_ids) == 60 and kv_idle(sched)


# -- the door ------------------------------------------------------------------------------------------

def test_admission_refuses_what_can_never_fit():
    sched = make_scheduler(num_blocks=8, block_size=16, max_model_len=100, draft_tokens=2)
    with pytest.raises(InvalidArgumentError, match=r"= 101 exceeds the context limit of 100") as e:
        sched.add_request(make_request(prompt=60, max_tokens=41))
    assert e.value.field == "max_tokens"
    sched = make_scheduler(num_blocks=8, block_size=16, max_model_len=1000, draft_tokens=2)
    with pytest.raises(InvalidArgumentError, match=r"KV capacity of 128 tokens") as e:
        sched.add_request(make_request(prompt=60, max_tokens=67))
    assert e.value.field == "max_tokens"
    sched.add_request(make_request(prompt=60, max_tokens=66))             # 126 + 2 draft slots fit
    assert not sched.kv.refs_taken and len(sched.waiting) == 1


# -- aborts on a real engine -----------------------------------------------------------------------------

@pytest.fixture
def core():
    return EngineCore(EngineConfig(kv_capacity=1024, prefill_chunk=16, draft_tokens=2, max_batch=4),
                      clock=FakeClock(0.0))


def test_abort_while_queued(core):
    a = core.add_request(list(range(1, 50)), SamplingParams(max_tokens=5, temperature=0.0))
    out = core.abort(a.request_id)
    assert out.finished and out.finish_reason == "abort" and out.stats.usage.completion_tokens == 0
    assert_kv_idle(core)
    assert run_to_idle(core) == []


def test_abort_mid_prefill(core):
    a = core.add_request(list(range(1, 100)), SamplingParams(max_tokens=5, temperature=0.0))
    core.step()
    core.step()
    assert core.scheduler.lane.requests == [a] and a.num_computed_tokens == 32 and a.block_ids
    core.abort(a.request_id)
    assert not core.scheduler.lane
    assert_kv_idle(core)
    b = core.add_request(list(range(1, 40)), SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0))
    run_to_idle(core)
    assert b.finish_reason is FinishReason.LENGTH and len(b.output_token_ids) == 3
    assert_kv_idle(core)


def test_abort_during_decode_with_others_running(core):
    a = core.add_request(list(range(1, 30)), SamplingParams(max_tokens=50, ignore_eos=True, temperature=0.0))
    b = core.add_request(list(range(31, 60)), SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0))
    while len(b.output_token_ids) < 3:
        core.step()
    assert a.status is RequestStatus.RUNNING
    core.abort(a.request_id)
    run_to_idle(core)
    assert a.finish_reason is FinishReason.ABORT and b.finish_reason is FinishReason.LENGTH
    assert_kv_idle(core)
    with pytest.raises(KeyError):
        core.abort(a.request_id)                           # gone: RequestNotFoundError


def test_abort_of_a_parked_request(core):
    a = core.add_request(list(range(1, 30)), SamplingParams(max_tokens=5, temperature=0.0), park_after_prefill=True)
    out = run_to_idle(core)
    assert a.status is RequestStatus.PARKED and [o.new_token_ids for o in out] == [a.output_token_ids]
    core.abort(a.request_id)
    assert_kv_idle(core)


def ids(n: int, stride: int = 1) -> list[int]:
    return [(i * stride) % 379 + 1 for i in range(n)]


def test_finished_requests_release_their_hidden_state_rows(core):
    """Each request decoding with MTP holds a row of the runner's hidden-state pool (max_batch rows).
    A request that ends while nothing else can run -- here a parked request holds most of the KV and
    the next prompt must wait for it -- must still give its row back; otherwise, a few such endings
    later, a prefill finds no row at all."""
    runner = runner_of(core)
    rows = len(runner.hidden._free)
    for i in range(rows + 2):
        parked = core.add_request(ids(700), SamplingParams(max_tokens=2, temperature=0.0), park_after_prefill=True)
        run_to_idle(core)
        short = core.add_request([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0))
        run_to_idle(core)                              # finishes; its id waits for the runner
        big = core.add_request(ids(400, stride=7), SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0))
        core.step()                                    # nothing can run: the parked prefill holds the KV
        assert big.status is RequestStatus.WAITING
        core.abort(parked.request_id)
        run_to_idle(core)
        assert short.finish_reason is FinishReason.LENGTH and big.finish_reason is FinishReason.LENGTH, i
        assert_kv_idle(core)
    core.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0))
    run_to_idle(core)
    core.step()                                        # the next step hands the last ending to the runner
    assert len(runner.hidden._free) == rows and not runner.hidden.rows


def test_pending_timeout_on_a_real_engine_with_a_busy_lane():
    """A long prompt holds the prefill lane chunk by chunk; the request queued behind it times out
    (finish_reason queue_timeout, no tokens, nothing held) while the lane's request carries on."""
    clock = FakeClock(0.0)
    core = EngineCore(EngineConfig(kv_capacity=2048, prefill_chunk=16, pending_timeout_ms=100), clock=clock)
    long = core.add_request(ids(600, stride=3), SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0))
    queued = core.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
    outs = core.step()
    assert core.scheduler.lane.requests == [long] and outs == []
    clock.advance(0.05)
    assert core.step() == [] and queued.status is RequestStatus.WAITING
    clock.advance(0.06)                                   # 0.11 s in the queue > 100 ms
    outs = core.step()
    assert [(o.request_id, o.finish_reason) for o in outs if o.finished] == [(queued.request_id, "queue_timeout")]
    timed_out = next(o for o in outs if o.finished)
    assert timed_out.stats.usage.completion_tokens == 0 and timed_out.stats.timings.queue == pytest.approx(0.11)
    assert long.status is RequestStatus.PREFILLING
    run_to_idle(core)
    assert long.finish_reason is FinishReason.LENGTH and core.metrics.snapshot(clock(), {}, {})["performance"][
        "requests"] == {"queue_timeout": 1, "length": 1}
    assert_kv_idle(core)


# -- parked requests: no decode seat, a cap of their own (issue 12) -----------------------------------

def park_one(sched, **kw):
    req = make_request(prompt=8, max_tokens=50, **kw)
    req.park_after_prefill = True
    sched.add_request(req)
    while req.status is not RequestStatus.PARKED:
        step(sched)
    return req


def test_parked_requests_take_no_decode_seat():
    sched = make_scheduler(max_batch=2)
    parked = [park_one(sched), park_one(sched)]
    runner = make_request(prompt=8, max_tokens=3)
    sched.add_request(runner)
    for _ in range(10):
        step(sched)
    assert runner.finish_reason is FinishReason.LENGTH, "a parked handle held a decode seat"
    for p in parked:
        sched.finish(p.request_id, FinishReason.ABORT)
    assert kv_idle(sched)


def test_at_most_max_parked_wait_parked_and_the_next_one_queues():
    sched = make_scheduler(max_batch=4, max_parked=1)
    first = park_one(sched)
    second = make_request(prompt=8, max_tokens=5)
    second.park_after_prefill = True
    sched.add_request(second)
    for _ in range(5):
        step(sched)
    assert second.status is RequestStatus.WAITING, "a second handle parked beyond max_parked"
    sched.finish(first.request_id, FinishReason.ABORT)
    step(sched)
    assert second.status is RequestStatus.PARKED
    sched.finish(second.request_id, FinishReason.ABORT)
    assert kv_idle(sched)


def test_an_attached_request_waits_for_a_seat_and_the_batch_never_exceeds_max_batch():
    sched = make_scheduler(max_batch=1)
    parked = park_one(sched)
    busy = make_request(prompt=8, max_tokens=4)
    sched.add_request(busy)
    step(sched)
    sched.resume(parked.request_id)
    widths = []
    while sched.has_work:
        out = sched.schedule()
        widths.append(len(out.decode))
        model_step(sched, out)
    assert max(widths) == 1 and busy.finish_reason is parked.finish_reason is FinishReason.LENGTH
    assert parked.times.decode_start >= busy.times.finish
    assert kv_idle(sched)


def test_an_unclaimed_split_request_can_be_released_before_it_parks():
    sched = make_scheduler()
    req = make_request(prompt=8, max_tokens=5)
    req.park_after_prefill = True
    sched.add_request(req)
    assert sched.is_unclaimed(req.request_id)                # queued: a Release ends it before it parks
    while req.status is not RequestStatus.PARKED:
        step(sched)
    assert sched.is_unclaimed(req.request_id)
    sched.resume(req.request_id)
    assert not sched.is_unclaimed(req.request_id)            # attached: the decode owns it
    sched.finish(req.request_id, FinishReason.ABORT)
    assert kv_idle(sched) and not sched.attached
