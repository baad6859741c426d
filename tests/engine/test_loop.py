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

from tests.conftest import make_llm
from engine import QueueFullError, QueueTimeoutError, RequestNotFoundError, SamplingParams
from engine.core import EngineCore
from engine.errors import EngineDeadError
from engine.loop import EngineLoop
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
        stream = loop.submit(PROMPT, SamplingParams(max_tokens=10, temperature=0.0), request_id="h", park_after_prefill=True)
        assert not stream.next(timeout=30).finished
        final = stream.next(timeout=5)                    # the idle loop expires the lease
        assert final.finished and final.finish_reason == "lease_expired"
        assert kv_state(loop) == (0, 0, 0)
        with pytest.raises(RequestNotFoundError):
            loop.resume("h")
    finally:
        loop.shutdown()


def test_queue_timeout_and_queue_full_through_the_loop():
    # 300 ms, not less: `late` must start within it once `busy` is aborted, and a loaded CI machine can take
    # tens of milliseconds to run the abort and the next schedule
    loop = start(max_batch=1, max_pending=1, pending_timeout_ms=300)
    try:
        busy = loop.submit(PROMPT, SamplingParams(max_tokens=1900, ignore_eos=True, temperature=0.0))
        busy.next(timeout=30)                             # running: it holds the only batch slot
        waiting = loop.submit([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
        with pytest.raises(QueueFullError):
            loop.submit([4, 5, 6], SamplingParams(max_tokens=2, temperature=0.0))          # refused at once
        with pytest.raises(QueueTimeoutError, match="pending_timeout_ms=300"):
            waiting.next(timeout=10)
        assert waiting.finished
        late = loop.submit([4, 5, 6], SamplingParams(max_tokens=2, temperature=0.0))     # room again after the timeout
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
        stream = loop.submit(PROMPT, SamplingParams(max_tokens=1900, ignore_eos=True, temperature=0.0))
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
        loop.submit([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))


def test_validation_errors_reach_the_caller_synchronously():
    loop = start()
    try:
        with pytest.raises(Exception) as e:
            loop.submit([1, 2, 10**6], SamplingParams(max_tokens=2, temperature=0.0))
        assert getattr(e.value, "field", None) == "prompt_token_ids"
        assert loop.alive and kv_state(loop) == (0, 0, 0)
    finally:
        loop.shutdown()


def test_loop_outputs_equal_llm_generate():
    llm = make_llm(None, kv_capacity=2048, prefill_chunk=32)
    want = llm.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0))[0].token_ids
    loop = EngineLoop(llm.engine).start()
    try:
        assert [t for o in loop.submit(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)) for t in o.new_token_ids] == want
    finally:
        loop.shutdown()
