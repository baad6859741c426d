"""The EngineLoop API the services use, on the embedded default model: the prefill/decode split (park
after prefill, read the first token, resume, read the rest) gives the tokens of a plain request; an
expired lease frees the KV and the handle; the pending queue's timeout and limit surface as
QueueTimeoutError and QueueFullError; an abort from another thread ends the stream; a stopped loop
refuses work."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from conftest import make_llm
from engine import QueueFullError, QueueTimeoutError, RequestNotFoundError, SamplingParams
from engine.core import EngineCore
from engine.errors import EngineDeadError
from engine.loop import EngineLoop, RequestStream
from engine import EngineConfig

PROMPT = list(range(40, 90))


def kv_state(loop: EngineLoop) -> tuple[int, int, int]:
    return loop.call(lambda c: (c.kv.num_blocks - c.kv.num_free_blocks, c.kv.refs_taken - c.kv.refs_dropped,
                                len(c.scheduler.requests)))


def start(**cfg) -> EngineLoop:
    return EngineLoop(EngineCore(EngineConfig(**{"kv_capacity": 2048, "prefill_chunk": 32, **cfg}))).start()


@pytest.mark.parametrize("k", [0, 2])
def test_park_then_resume_equals_a_plain_request(k):
    loop = start(draft_tokens=k)
    try:
        params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.9, seed=5)
        plain = [t for o in loop.submit(PROMPT, params) for t in o.new_token_ids]
        stream = loop.submit(PROMPT, params, request_id="handle-1", park_after_prefill=True)
        first = stream.next(timeout=30)
        assert not first.finished and len(first.new_token_ids) == 1 and first.new_token_ids == plain[:1]
        time.sleep(0.05)                                  # parked: nothing more arrives, KV is held
        with pytest.raises(queue.Empty):
            stream.next(timeout=0.05)
        assert kv_state(loop)[0] > 0
        assert loop.resume("handle-1") is stream
        rest = list(stream)
        assert first.new_token_ids + [t for o in rest for t in o.new_token_ids] == plain
        final = rest[-1]
        assert final.finished and final.finish_reason == "length" and final.stats.usage.completion_tokens == 20
        t = final.stats.timings
        assert t.total >= t.ttft + t.decode + 0.05 - 1e-6     # the parked time is in neither phase
        with pytest.raises(RequestNotFoundError):
            loop.resume("handle-1")                       # attached once
        assert kv_state(loop) == (0, 0, 0)
    finally:
        loop.shutdown()


def test_expired_lease_frees_the_kv():
    loop = start(lease_seconds=0.05)
    try:
        stream = loop.submit(PROMPT, SamplingParams(max_tokens=10), request_id="h", park_after_prefill=True)
        assert not stream.next(timeout=30).finished
        final = stream.next(timeout=5)                    # the idle loop expires the lease
        assert final.finished and final.finish_reason == "lease_expired"
        assert kv_state(loop) == (0, 0, 0)
        with pytest.raises(RequestNotFoundError):
            loop.resume("h")
    finally:
        loop.shutdown()


def test_queue_timeout_and_queue_full_through_the_loop():
    loop = start(max_batch=1, max_pending=1, pending_timeout_ms=30)
    try:
        busy = loop.submit(PROMPT, SamplingParams(max_tokens=1900, ignore_eos=True))
        busy.next(timeout=30)                             # running: it holds the only batch slot
        waiting = loop.submit([1, 2, 3], SamplingParams(max_tokens=2))
        with pytest.raises(QueueFullError):
            loop.submit([4, 5, 6], SamplingParams(max_tokens=2))          # refused at once
        with pytest.raises(QueueTimeoutError, match="pending_timeout_ms=30"):
            waiting.next(timeout=10)
        assert waiting.finished
        late = loop.submit([4, 5, 6], SamplingParams(max_tokens=2))     # room again after the timeout
        busy.abort()
        outs = list(busy)
        assert outs[-1].finished and outs[-1].finish_reason == "abort"
        assert list(late)[-1].finish_reason in ("length", "stop")
        assert kv_state(loop) == (0, 0, 0)
    finally:
        loop.shutdown()


def test_abort_from_another_thread_ends_the_stream():
    loop = start(draft_tokens=2)
    try:
        stream = loop.submit(PROMPT, SamplingParams(max_tokens=1900, ignore_eos=True))
        got = [stream.next(timeout=30)]
        threading.Thread(target=stream.abort).start()
        got += list(stream)
        assert got[-1].finished and got[-1].finish_reason == "abort"
        assert got[-1].stats.usage.completion_tokens == sum(len(o.new_token_ids) for o in got) < 1900
        assert kv_state(loop) == (0, 0, 0)
        loop.abort("no-such-request")                     # unknown ids are ignored
        assert loop.alive
    finally:
        loop.shutdown()


def test_a_stopped_loop_refuses_work():
    loop = start()
    loop.shutdown()
    with pytest.raises(EngineDeadError):
        loop.submit([1, 2, 3], SamplingParams(max_tokens=2))


def test_validation_errors_reach_the_caller_synchronously():
    loop = start()
    try:
        with pytest.raises(Exception) as e:
            loop.submit([1, 2, 10**6], SamplingParams(max_tokens=2))
        assert getattr(e.value, "field", None) == "prompt_token_ids"
        assert loop.alive and kv_state(loop) == (0, 0, 0)
    finally:
        loop.shutdown()


def test_loop_outputs_equal_llm_generate():
    llm = make_llm(None, kv_capacity=2048, prefill_chunk=32)
    want = llm.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    loop = EngineLoop(llm.engine).start()
    try:
        assert [t for o in loop.submit(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True)) for t in o.new_token_ids] == want
    finally:
        loop.shutdown()


def wait_idle(loop: EngineLoop, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while kv_state(loop) != (0, 0, 0):
        assert time.monotonic() < deadline, "the engine did not finish the request"
        time.sleep(0.01)


@pytest.mark.parametrize("k", [0, 2])
def test_a_reader_that_fell_behind_gets_the_waiting_steps_in_one_output(k):
    loop = start(draft_tokens=k)
    try:
        params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=3)
        plain = list(loop.submit(PROMPT, params))
        assert len(plain) > 2, "several engine steps, so there is something to merge"
        stream = loop.submit(PROMPT, params)
        wait_idle(loop)                                   # every step's output is waiting, none read
        merged = list(stream.coalesced())
        assert len(merged) == 1 and stream.finished
        assert merged[0].new_token_ids == [t for o in plain for t in o.new_token_ids]
        assert merged[0].finished and merged[0].finish_reason == plain[-1].finish_reason
        assert merged[0].stats.usage.completion_tokens == 24

        # a reader that keeps up gets one output per step, as the plain iteration does
        stream = loop.submit(PROMPT, params)
        kept_up = list(stream.coalesced())
        assert [t for o in kept_up for t in o.new_token_ids] == [t for o in plain for t in o.new_token_ids]
        assert kept_up[-1].finished and not any(o.finished for o in kept_up[:-1])
    finally:
        loop.shutdown()


def test_a_parked_first_output_is_not_merged_with_the_decode_after_it():
    loop = start()
    try:
        params = SamplingParams(max_tokens=10, ignore_eos=True)
        stream = loop.submit(PROMPT, params, request_id="parked", park_after_prefill=True)
        deadline = time.monotonic() + 30
        while loop.call(lambda c: len(c.scheduler.parked)) == 0:    # parked: its first output is waiting
            assert time.monotonic() < deadline
            time.sleep(0.01)
        loop.resume("parked")
        wait_idle(loop)
        first = stream.next_coalesced()
        assert len(first.new_token_ids) == 1 and first.stats is not None and not first.finished
        rest = stream.next_coalesced()                    # the decode's nine tokens, one output, the final stats
        assert len(rest.new_token_ids) == 9 and rest.finished and rest.stats.usage.completion_tokens == 10
        assert rest.stats.timings.ttft == first.stats.timings.ttft
    finally:
        loop.shutdown()


def test_an_error_after_waiting_outputs_comes_after_them():
    from engine.core import RequestOutput
    stream = RequestStream("r", loop=None)
    stream._put(RequestOutput("r", [1], finished=False))
    stream._put(RequestOutput("r", [2, 3], finished=False))
    stream._put(EngineDeadError("the engine thread died"))
    out = stream.next_coalesced()
    assert out.new_token_ids == [1, 2, 3] and not out.finished and not stream.finished
    with pytest.raises(EngineDeadError):
        stream.next_coalesced()
    assert stream.finished
