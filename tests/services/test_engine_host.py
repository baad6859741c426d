"""The engine process's services, called directly over gRPC on 127.0.0.1 (embedded model):
prefill/decode through a handle, release, lease expiry, unknown handles, health, the metrics rpc."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2

from engine.config import EngineConfig
from gateway.client import GatewayClient, SamplingParams
from gateway.server import GatewayServer
from ninfer.v1 import common_pb2
from services.engine_client import EngineClient
from services.engine_host import EngineHost
from services.server.grpc_server import ServerOptions

LEASE_S = 0.5
PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def host():
    h = EngineHost(EngineConfig(kv_capacity=4096, lease_seconds=LEASE_S),
                   ServerOptions(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0")).start().load()
    yield h
    h.stop()


@pytest.fixture(scope="module")
def engine(host):
    with EngineClient(host.address) as client:
        yield client


def assert_kv_baseline(engine: EngineClient) -> None:
    m = engine.wait_idle()
    assert (m.queue.waiting, m.queue.prefilling, m.queue.running, m.queue.parked) == (0, 0, 0, 0)
    assert m.kv.free_blocks == m.kv.num_blocks, f"{m.kv.num_blocks - m.kv.free_blocks} KV blocks still held"
    assert m.kv.refs_taken == m.kv.refs_dropped


def finished(engine: EngineClient, reason: str) -> int:
    return engine.metrics().performance.requests.get(reason, 0)


def test_prefill_returns_a_handle_and_decode_streams_the_rest(engine):
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    first = engine.prefill(PROMPT, sampling)
    assert first.handle and not first.finished and len(first.token_ids) == 1
    assert first.lease_seconds == LEASE_S
    assert first.stats.usage.prompt_tokens == len(PROMPT) and first.stats.usage.computed_prefill_tokens > 0
    assert first.stats.timings.ttft_seconds > 0 and first.stats.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    msgs = list(engine.decode(first.handle))
    assert [m.finished for m in msgs] == [False] * (len(msgs) - 1) + [True]
    stats = msgs[-1].stats
    assert len(first.token_ids) + sum(len(m.token_ids) for m in msgs) == 6 == stats.usage.completion_tokens
    assert stats.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert stats.timings.ttft_seconds == first.stats.timings.ttft_seconds, "one request, one set of timings"
    assert_kv_baseline(engine)


def test_a_first_token_that_ends_the_request_keeps_no_handle(engine):
    first = engine.prefill(PROMPT, SamplingParams(max_tokens=1))
    assert first.finished and first.stats.finish_reason == common_pb2.FINISH_REASON_LENGTH
    with pytest.raises(grpc.RpcError) as e:
        list(engine.decode(first.handle))
    assert e.value.code() is grpc.StatusCode.NOT_FOUND
    assert_kv_baseline(engine)


def test_release_frees_a_handle_that_no_decode_takes(engine):
    aborted = finished(engine, "abort")
    first = engine.prefill(PROMPT, SamplingParams(max_tokens=50))
    assert engine.metrics().queue.parked == 1
    engine.release(first.handle)
    assert_kv_baseline(engine)
    assert finished(engine, "abort") == aborted + 1
    for call in (lambda: list(engine.decode(first.handle)), lambda: engine.release(first.handle)):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() is grpc.StatusCode.NOT_FOUND
        assert first.handle in e.value.details()


def test_an_expired_lease_frees_the_kv_and_the_handle_is_gone(engine):
    expired = finished(engine, "lease_expired")
    first = engine.prefill(PROMPT, SamplingParams(max_tokens=50))
    deadline = time.monotonic() + 30
    while engine.metrics().queue.parked and time.monotonic() < deadline:
        time.sleep(LEASE_S / 5)
    assert_kv_baseline(engine)
    assert finished(engine, "lease_expired") == expired + 1
    with pytest.raises(grpc.RpcError) as e:
        list(engine.decode(first.handle))
    assert e.value.code() is grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("handle", ["", "no-such-handle"])
def test_an_unknown_handle_is_not_found(engine, handle):
    with pytest.raises(grpc.RpcError) as e:
        list(engine.decode(handle))
    assert e.value.code() is grpc.StatusCode.NOT_FOUND


def test_the_metrics_rpc_returns_the_snapshot_contract(engine, host):
    list(engine.decode(engine.prefill(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True)).handle))
    m = engine.metrics()
    snap = host.loop.metrics()
    assert list(m.history.decode_tokens) == snap["history"]["decode_tokens"][:len(m.history.decode_tokens)]
    assert sum(m.history.decode_tokens) > 0 and len(m.history.interval_seconds) == len(m.history.prefill_tokens)
    assert m.last.completion_tokens == 4 and m.last.HasField("ttft_s")
    assert m.last.peak_tok_s >= m.last.decode_tok_s > 0
    assert dict(m.performance.requests) == snap["performance"]["requests"]
    assert m.kv.capacity_tokens == 4096 and m.kv.num_blocks == m.kv.capacity_tokens // m.kv.block_size
    info = engine.model_info()
    assert info.model == "ninfer-embedded-tiny" and info.vocab_size == 384 and len(info.tokenizer_sha256) == 64


def test_engine_prometheus_endpoint(engine, host):
    list(engine.decode(engine.prefill(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True)).handle))
    text = urllib.request.urlopen(f"http://127.0.0.1:{host.metrics_port}/metrics", timeout=10).read().decode()
    for name in ("ninfer_engine_time_to_first_token_seconds_count", "ninfer_engine_inter_token_latency_seconds_count",
                 "ninfer_engine_queue_wait_seconds_count", "ninfer_engine_queue_length",
                 "ninfer_engine_prefill_tokens_total", "ninfer_engine_generated_tokens_total",
                 "ninfer_engine_kv_cache_usage_ratio", 'ninfer_engine_requests_finished_total{finish_reason="length"}',
                 'ninfer_engine_requests{state="parked"}'):
        assert name in text, name
    assert host.registry.get_sample_value("ninfer_engine_kv_free_blocks") == 4096 // 16


def test_health_is_not_serving_until_the_engine_is_warm_and_the_gateway_follows():
    host = EngineHost(EngineConfig(kv_capacity=4096), ServerOptions(listen="127.0.0.1:0")).start()
    gateway = GatewayServer([host.address], ServerOptions(listen="127.0.0.1:0"), poll_interval_s=0.05).start()
    client = GatewayClient(gateway.address)
    try:
        with EngineClient(host.address) as engine:
            assert engine.serving_status() == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as e:
                engine.prefill(PROMPT)
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE and "loading" in e.value.details()
            assert client.serving_status() == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as e:
                list(client.generate("hi"))
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE
            host.load()
            assert engine.serving_status() == health_pb2.HealthCheckResponse.SERVING
            client.wait_until_serving(timeout_s=30)
            assert list(client.generate("hi", sampling=SamplingParams(max_tokens=2)))[-1].HasField("result")
    finally:
        client.close()
        gateway.stop()
        host.stop()
