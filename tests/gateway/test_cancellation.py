"""Flow control through a real gateway and engine: client cancels (mid-stream, while queued),
deadlines (while queued, mid-decode), a full queue and queue timeouts. After each, the engine is idle
and its free KV is back at its baseline.

The engine runs one request at a time (max_batch=1). A request prefilled directly on the engine and
left parked holds that slot, so that requests through the gateway queue behind it deterministically.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from engine.config import EngineConfig
from gateway.client import GatewayClient, SamplingParams
from gateway.serve import ServeStack
from services.engine_client import EngineClient
from services.server.errors import RETRY_PUSHBACK_KEY
from services.server.grpc_server import ServerOptions
from tests.support.polling import wait_until

MAX_PENDING = 2
PENDING_TIMEOUT_MS = 2000
PUSHBACK_MS = 250
LONG = SamplingParams(max_tokens=4000, ignore_eos=True)      # far longer than any test waits
SHORT = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def stack():
    s = ServeStack(EngineConfig(kv_capacity=4096, max_batch=1, max_pending=MAX_PENDING,
                                pending_timeout_ms=PENDING_TIMEOUT_MS),
                   ServerOptions(listen="127.0.0.1:0", retry_pushback_ms=PUSHBACK_MS)).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine(stack):
    with EngineClient(stack.engine.address, stack.engine_api_key) as e:
        yield e


def assert_idle_at_baseline(engine: EngineClient):
    m = engine.wait_idle()
    q = m.queue
    assert (q.waiting, q.prefilling, q.running, q.parked) == (0, 0, 0, 0)
    assert m.kv.free_blocks == m.kv.num_blocks and m.kv.refs_taken == m.kv.refs_dropped
    return m


def finished(engine: EngineClient, reason: str) -> int:
    return engine.metrics().performance.requests.get(reason, 0)


class Background:
    """A Generate call consumed on a thread: its text, its last message or its error."""

    def __init__(self, client: GatewayClient, prompt: str, sampling, timeout: float | None = None):
        self.call = client.generate(prompt, sampling=sampling, include_token_ids=True, timeout=timeout)
        self.text, self.ids, self.last, self.error = "", [], None, None
        self.thread = threading.Thread(target=self._consume, daemon=True)
        self.thread.start()

    def _consume(self) -> None:
        try:
            for self.last in self.call:
                self.text += self.last.text
                self.ids += list(self.last.token_ids)
        except grpc.RpcError as e:
            self.error = e

    def join(self) -> "Background":
        self.thread.join(60)
        assert not self.thread.is_alive()
        return self


def hold_the_batch_slot(engine: EngineClient):
    """Park a prefilled request: with max_batch=1 nothing else is admitted until it decodes."""
    return engine.prefill([40, 41, 42, 43], SHORT)


def test_cancel_mid_stream_aborts_the_engine_request(client, engine, stack):
    before = stack.registry.get_sample_value("ninfer_engine_generated_tokens_total")
    aborted = finished(engine, "abort")
    call = client.generate("cancel me", sampling=LONG)
    for _ in range(3):
        next(call)
    call.cancel()
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() is grpc.StatusCode.CANCELLED
    assert_idle_at_baseline(engine)
    assert finished(engine, "abort") == aborted + 1

    def generated() -> float:          # the decode service counts an aborted request's tokens too
        return stack.registry.get_sample_value("ninfer_engine_generated_tokens_total") - before
    wait_until(lambda: generated() > 0)
    assert 3 <= generated() < LONG.max_tokens, "the engine stopped decoding when the client went away"
    wait_until(lambda: stack.registry.get_sample_value("ninfer_gateway_requests_total", {"status": "CANCELLED"}))


def test_cancel_while_queued_removes_the_request(client, engine):
    aborted = finished(engine, "abort")
    slot = hold_the_batch_slot(engine)
    waiting = Background(client, "queued", SHORT)
    wait_until(lambda: engine.metrics().queue.waiting == 1)
    waiting.call.cancel()
    assert waiting.join().error.code() is grpc.StatusCode.CANCELLED
    wait_until(lambda: engine.metrics().queue.waiting == 0)
    assert finished(engine, "abort") == aborted + 1
    engine.release(slot.handle)
    assert_idle_at_baseline(engine)


def test_a_deadline_while_queued_is_deadline_exceeded_and_frees_everything(client, engine):
    aborted = finished(engine, "abort")
    slot = hold_the_batch_slot(engine)
    late = Background(client, "too late", SHORT, timeout=0.5).join()
    assert late.error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: engine.metrics().queue.waiting == 0)          # the engine saw the deadline too
    engine.release(slot.handle)
    assert_idle_at_baseline(engine)
    assert finished(engine, "abort") == aborted + 2                 # the late request and the slot


def test_a_deadline_mid_decode_is_deadline_exceeded_and_frees_everything(client, engine):
    aborted = finished(engine, "abort")
    late = Background(client, "long story", LONG, timeout=1.0).join()
    assert late.error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0 < len(late.ids) < LONG.max_tokens
    assert_idle_at_baseline(engine)
    assert finished(engine, "abort") == aborted + 1


def test_queue_full_refuses_exactly_the_excess_and_the_rest_finish_unchanged(client, engine):
    reference = Background(client, "same prompt", SHORT).join()
    assert reference.error is None
    slot = hold_the_batch_slot(engine)
    calls = [Background(client, "same prompt", SHORT) for _ in range(MAX_PENDING + 2)]
    wait_until(lambda: sum(c.error is not None for c in calls) == 2)
    refused = [c for c in calls if c.error is not None]
    for c in refused:
        assert c.error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"the pending queue is full ({MAX_PENDING} requests)" in c.error.details()
        assert (RETRY_PUSHBACK_KEY, str(PUSHBACK_MS)) in [(m.key, m.value) for m in c.error.trailing_metadata()]
    assert engine.metrics().queue.waiting == MAX_PENDING
    list(engine.decode(slot.handle))                                  # the slot frees: the queue drains
    served = [c.join() for c in calls if c not in refused]
    assert len(served) == MAX_PENDING
    for c in served:
        assert c.error is None and (c.text, c.ids) == (reference.text, reference.ids)
    assert_idle_at_baseline(engine)


def test_queue_timeout_refuses_the_requests_that_waited_too_long(client, engine):
    timed_out = finished(engine, "queue_timeout")
    slot = hold_the_batch_slot(engine)
    calls = [Background(client, "patience", SHORT) for _ in range(2)]
    for c in calls:
        c.join()
        assert c.error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"pending_timeout_ms={PENDING_TIMEOUT_MS}" in c.error.details()
        assert (RETRY_PUSHBACK_KEY, str(PUSHBACK_MS)) in [(m.key, m.value) for m in c.error.trailing_metadata()]
    msgs = list(engine.decode(slot.handle))                           # the request holding the slot is intact
    assert len(slot.token_ids) + sum(len(m.token_ids) for m in msgs) == SHORT.max_tokens
    assert_idle_at_baseline(engine)
    assert finished(engine, "queue_timeout") == timed_out + 2
