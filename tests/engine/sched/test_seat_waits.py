"""Seats and waits (issue 39, item 4), on the real scheduler with a fake clock: an abandoned handle
holds admission only until --handoff-timeout once a request waits for its room (not for its whole
lease), and a prefilled request waits for a decode seat at most --seat-timeout."""

from __future__ import annotations

from engine.sched.request import FinishReason, RequestStatus
from tests.conftest import FakeClock, make_request, make_scheduler, model_step
from tests.engine.sched.test_scheduler import kv_idle, park_one, step

HANDOFF_S = 2.0
LEASE_S = 60.0


def test_abandoned_handles_give_their_room_to_a_queued_request_after_the_handoff_timeout():
    clock = FakeClock(0.0)
    sched = make_scheduler(max_batch=2, clock=clock, lease_s=LEASE_S, handoff_timeout_s=HANDOFF_S)
    abandoned = [park_one(sched), park_one(sched)]          # max_parked = max_batch = 2: the room is full
    clock.advance(0.5)
    newcomer = make_request(prompt=8, max_tokens=4)
    newcomer.park_after_prefill = True
    sched.add_request(newcomer)
    for _ in range(5):
        sched.expire()
        step(sched)
    assert newcomer.status is RequestStatus.WAITING and not any(r.finished for r in abandoned)
    assert sched.waits()["oldest_parked_s"] == 0.5
    clock.advance(HANDOFF_S)                                 # 2.5 s: older than the handoff timeout
    dropped = sched.expire()
    assert dropped == [abandoned[0]] and abandoned[0].finish_reason is FinishReason.LEASE_EXPIRED
    assert not abandoned[1].finished, "only as many handles as the queue's head needs"
    while newcomer.status is not RequestStatus.PARKED:
        step(sched)
    assert clock.t < LEASE_S, "admitted long before the abandoned handles' lease"
    for r in (abandoned[1], newcomer):
        sched.finish(r.request_id, FinishReason.ABORT)
    assert kv_idle(sched)


def test_handles_keep_their_lease_while_no_one_waits_for_their_room():
    clock = FakeClock(0.0)
    sched = make_scheduler(max_batch=2, clock=clock, lease_s=LEASE_S, handoff_timeout_s=HANDOFF_S)
    handles = [park_one(sched), park_one(sched)]
    clock.advance(30.0)
    assert sched.expire() == [] and not any(h.finished for h in handles)
    clock.advance(31.0)
    assert sorted(sched.expire(), key=id) == sorted(handles, key=id)
    assert kv_idle(sched)


def test_a_prefilled_request_waits_for_a_seat_at_most_the_seat_timeout():
    clock = FakeClock(0.0)
    sched = make_scheduler(max_batch=1, clock=clock, seat_timeout_s=3.0)
    waiting = park_one(sched)
    busy = make_request(prompt=8, max_tokens=1000)
    sched.add_request(busy)
    step(sched)
    sched.resume(waiting.request_id)                         # attached: waits for busy's seat
    for _ in range(3):
        clock.advance(1.0)
        sched.expire()
        model_step(sched, sched.schedule())
        assert sched.waits()["oldest_awaiting_seat_s"] <= 3.0
    assert not waiting.finished and busy.status is RequestStatus.RUNNING
    clock.advance(0.5)
    assert sched.expire() == [waiting] and waiting.finish_reason is FinishReason.QUEUE_TIMEOUT
    assert sched.waits()["oldest_awaiting_seat_s"] == 0.0
    sched.finish(busy.request_id, FinishReason.ABORT)
    assert kv_idle(sched)
