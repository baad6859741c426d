"""The serving edge under floods and hostile input (issue 12): a concurrency limit that refuses with
retry pushback while health answers; sizes checked before tokenizing; an unset max_tokens clamped
to the context; a tiny temperature is greedy; deadlines counted as such; a bounded drain that cuts
late streams UNAVAILABLE; an unready gateway that says why; lease expiries in the log."""

from __future__ import annotations

import time

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2

from engine.config import EngineConfig
from gateway.client import GatewayClient, SamplingParams
from gateway.prepare import MAX_CHARS_PER_TOKEN
from gateway.serve import ServeStack
from gateway.server import GatewayServer
from services.engine_client import EngineClient
from services.engine_host import EngineHost
from services.server.errors import RETRY_PUSHBACK_KEY, SHUT_DOWN_DETAILS
from services.server.grpc_server import ServerOptions
from tests.support.polling import wait_until

MAX_RPCS = 3
PUSHBACK_MS = 321
MAX_MODEL_LEN = 512
LONG = SamplingParams(max_tokens=MAX_MODEL_LEN - 20, ignore_eos=True)
FOREVER = SamplingParams(max_tokens=4000, ignore_eos=True)      # the default context: 4096


@pytest.fixture(scope="module")
def stack():
    s = ServeStack(EngineConfig(kv_capacity=4096, max_model_len=MAX_MODEL_LEN),
                   ServerOptions(listen="127.0.0.1:0", max_concurrent_rpcs=MAX_RPCS, retry_pushback_ms=PUSHBACK_MS)).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack):
    with GatewayClient(stack.address) as c:
        c.wait_until_serving(timeout_s=60)
        yield c


def failure(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        list(call())
    return e.value


def test_past_the_concurrency_limit_calls_are_refused_with_pushback_and_health_answers(client, stack):
    streams = [client.generate(f"hold {i}", sampling=LONG) for i in range(MAX_RPCS)]
    for s in streams:
        next(s)                                            # each stream is open and holds its slot
    try:
        e = failure(lambda: client.generate("one too many", sampling=SamplingParams(max_tokens=2), timeout=30))
        assert e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"limit of {MAX_RPCS} concurrent calls" in e.details()
        assert "--" not in e.details(), "no server flag reaches a public client"
        assert (RETRY_PUSHBACK_KEY, str(PUSHBACK_MS)) in [(m.key, m.value) for m in e.trailing_metadata()]
        for _ in range(20):                                # many probes, each answered at once
            assert client.serving_status(timeout=5) == health_pb2.HealthCheckResponse.SERVING
    finally:
        for s in streams:
            s.cancel()
    wait_until(lambda: stack.gateway.limiter.active == 0)
    assert list(client.generate("now there is room", sampling=SamplingParams(max_tokens=2)))[-1].HasField("result")


def test_a_prompt_too_long_to_fit_is_refused_before_tokenizing(client):
    limit = MAX_MODEL_LEN * MAX_CHARS_PER_TOKEN
    e = failure(lambda: client.generate("x" * (limit + 1)))
    assert e.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"{limit + 1} characters exceed the limit of {limit}" in e.details() and "max_model_len=512" in e.details()


@pytest.mark.parametrize("make, field", [
    (lambda c: c.generate(messages=[("user", "hi")] * (MAX_MODEL_LEN // 2 + 1)), "messages"),
    (lambda c: c.generate("hi", sampling=SamplingParams(stop=["s"] * 100_000)), "stop"),
    (lambda c: c.generate("hi", sampling=SamplingParams(stop_token_ids=[1] * 100_000)), "stop_token_ids"),
    (lambda c: c.generate(prompt_token_ids=[1] * 100_000), "prompt_token_ids"),
])
def test_counts_are_refused_by_name_before_any_work(client, make, field):
    e = failure(lambda: make(client))
    assert e.code() is grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith(f"{field}:"), e.details()


def test_an_unset_max_tokens_is_clamped_to_the_context_left(client):
    ids = [5] * (MAX_MODEL_LEN - 10)
    *_, last = client.generate(prompt_token_ids=ids, sampling=SamplingParams(ignore_eos=True))
    assert last.result.stats.usage.completion_tokens == 10
    e = failure(lambda: client.generate(prompt_token_ids=ids, sampling=SamplingParams(max_tokens=11)))
    assert e.code() is grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in e.details()     # set: it is named


def test_a_tiny_positive_temperature_is_greedy(client):
    def ids(temperature: float) -> list[int]:
        out = []
        for msg in client.generate("Once upon", sampling=SamplingParams(max_tokens=8, temperature=temperature,
                                                                          ignore_eos=True), include_token_ids=True):
            out += list(msg.token_ids)
        return out
    greedy = ids(0.0)
    assert ids(1e-40) == greedy == ids(5e-6)
    assert 0 not in greedy or greedy.count(0) < len(greedy)        # not the NaN -> token 0 of the issue


def test_a_deadline_is_counted_as_deadline_exceeded(client, stack):
    def count(status: str) -> float:
        return stack.registry.get_sample_value("ninfer_gateway_requests_total", {"status": status}) or 0.0
    before = count("DEADLINE_EXCEEDED")
    e = failure(lambda: client.generate("slow", sampling=LONG, timeout=0.3))
    assert e.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: count("DEADLINE_EXCEEDED") == before + 1)


def test_an_expired_lease_is_logged():
    host = EngineHost(EngineConfig(kv_capacity=1024, lease_seconds=0.2), ServerOptions(listen="127.0.0.1:0"))
    with structlog.testing.capture_logs() as logs:
        host.start().load()
        try:
            with EngineClient(host.address) as engine:
                handle = engine.prefill([5, 6, 7], SamplingParams(max_tokens=20)).handle
                wait_until(lambda: any(e["event"] == "lease_expired" for e in logs))
                assert engine.wait_idle(timeout_s=5).queue.parked == 0
        finally:
            host.stop()
    expired = [e for e in logs if e["event"] == "lease_expired"]
    assert expired[0]["request_id"] == handle and expired[0]["log_level"] == "warning"


def test_a_gateway_says_its_engine_is_draining():
    host = EngineHost(EngineConfig(kv_capacity=1024), ServerOptions(listen="127.0.0.1:0")).start().load()
    gateway = GatewayServer([host.address], ServerOptions(listen="127.0.0.1:0"), poll_interval_s=0.05).start()
    try:
        with GatewayClient(gateway.address) as client:
            client.wait_until_serving(timeout_s=30)
            host.state.drain()                                 # what SIGTERM does first
            wait_until(lambda: client.serving_status() == health_pb2.HealthCheckResponse.NOT_SERVING)
            e = failure(lambda: client.generate("hi"))
            assert e.code() is grpc.StatusCode.UNAVAILABLE
            assert f"{host.address}: draining" in e.details() and "not serving yet" not in e.details()
            host.stop()                                        # the engine has exited: no longer "draining"
            wait_until(lambda: "draining" not in failure(lambda: client.generate("hi")).details())
            e = failure(lambda: client.generate("hi"))
            assert e.code() is grpc.StatusCode.UNAVAILABLE and f"{host.address}: down" in e.details(), e.details()
    finally:
        gateway.stop()
        host.stop()


def test_a_standalone_gateway_sizes_its_limit_from_the_engines_it_talks_to():
    host = EngineHost(EngineConfig(kv_capacity=1024, max_batch=2, max_pending=3),
                      ServerOptions(listen="127.0.0.1:0")).start().load()
    gateway = GatewayServer([host.address, "127.0.0.1:1"], ServerOptions(listen="127.0.0.1:0"),
                            poll_interval_s=0.05).start()
    try:
        default = gateway.limiter.limit
        # the engine admits 2 x 2 + 3 + 1 = 8 calls; the other address has no engine (engine defaults)
        wait_until(lambda: gateway.limiter.limit == 8 + default // 2)
        assert gateway.registry.get_sample_value("ninfer_rpc_concurrency_limit",
                                                 {"server": "ninfer-gateway-rpc"}) == 8 + default // 2
    finally:
        gateway.stop()
        host.stop()


def test_drain_is_bounded_and_cuts_late_streams_with_unavailable():
    drain_s = 2.0
    s = ServeStack(EngineConfig(kv_capacity=4096), ServerOptions(listen="127.0.0.1:0", drain_timeout_s=drain_s)).start()
    try:
        with GatewayClient(s.address) as client:
            client.wait_until_serving(timeout_s=60)
            call = client.generate("forever", sampling=FOREVER)
            next(call)
            start = time.monotonic()
            assert s.drain() is False                          # the stream did not finish in time
            elapsed = time.monotonic() - start
            e = failure(lambda: call)
            assert e.code() is grpc.StatusCode.UNAVAILABLE and e.details() == SHUT_DOWN_DETAILS
            assert elapsed <= drain_s + 0.75, f"drain took {elapsed:.2f} s for --drain-timeout {drain_s}"
    finally:
        s.stop()
