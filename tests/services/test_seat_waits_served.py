"""Seats and waits over gRPC (issue 39, item 4): abandoned handles hold admission for
--handoff-timeout, not a lease; a prefilled request that finds no decode seat within --seat-timeout
ends RESOURCE_EXHAUSTED with retry pushback; the waits show in metrics."""

from __future__ import annotations

import time

import grpc
import pytest

from engine.config import EngineConfig
from gateway.client import SamplingParams
from services.engine_client import EngineClient
from services.engine_host import EngineHost
from services.server.errors import RETRY_PUSHBACK_KEY
from services.server.grpc_server import ServerOptions

HANDOFF_S = 0.3
SEAT_S = 0.5
LEASE_S = 60.0
LONG = SamplingParams(max_tokens=4000, ignore_eos=True)


@pytest.fixture(scope="module")
def host():
    h = EngineHost(EngineConfig(kv_capacity=8192, max_batch=1, lease_seconds=LEASE_S, handoff_timeout_seconds=HANDOFF_S,
                                seat_timeout_seconds=SEAT_S),
                   ServerOptions(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0")).start().load()
    yield h
    h.stop()


@pytest.fixture(scope="module")
def engine(host):
    with EngineClient(host.address) as client:
        yield client


def test_an_abandoned_handle_blocks_admission_for_the_handoff_timeout_not_its_lease(engine):
    abandoned = engine.prefill([5, 6, 7], LONG)              # max_batch 1: the only handle's room
    start = time.monotonic()
    newcomer = engine.prefill([8, 9, 10], SamplingParams(max_tokens=3, ignore_eos=True), timeout=10)
    waited = time.monotonic() - start
    assert HANDOFF_S * 0.8 <= waited < 5.0, waited
    with pytest.raises(grpc.RpcError) as e:
        list(engine.decode(abandoned.handle))
    assert e.value.code() is grpc.StatusCode.NOT_FOUND
    list(engine.decode(newcomer.handle))
    assert engine.metrics().performance.requests["lease_expired"] >= 1
    engine.wait_idle()


def test_a_request_without_a_decode_seat_ends_resource_exhausted_at_the_seat_timeout(engine, host):
    busy = engine.prefill([5, 6, 7], LONG)
    busy_stream = engine.decode(busy.handle)
    next(busy_stream)                                        # it holds the one seat
    waiting = engine.prefill([11, 12, 13], LONG)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(engine.decode(waiting.handle, timeout=10))
    waited = time.monotonic() - start
    assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
    assert f"no decode seat within seat_timeout_seconds={SEAT_S:g}" in e.value.details()
    assert any(k == RETRY_PUSHBACK_KEY for k, _ in e.value.trailing_metadata())
    assert SEAT_S * 0.8 <= waited < 5.0, waited
    assert host.registry.get_sample_value("ninfer_engine_requests", {"state": "awaiting_seat"}) == 0
    busy_stream.cancel()
    m = engine.wait_idle()
    assert m.kv.free_blocks == m.kv.num_blocks and m.queue.awaiting_seat == 0
