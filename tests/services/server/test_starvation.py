"""Servers that cannot be starved at the HTTP/2 layer (issue 39, item 1): hundreds of streams that
send their headers and never their request message, against a real gateway and engine on 127.0.0.1
(raw HTTP/2 from the `h2` library: no gRPC client does this). Health stays SERVING, a normal call
goes through, the stalled calls end DEADLINE_EXCEEDED at the receive timeout, the metrics count them;
connections are capped, idle ones closed, and each connection's stream cap is announced."""

from __future__ import annotations

import time

import pytest
from grpc_health.v1 import health_pb2

from engine.config import EngineConfig
from gateway.client import GatewayClient, SamplingParams
from gateway.serve import ServeStack
from services.engine_client import EngineClient
from services.engine_host import EngineHost
from services.server.connections import ConnectionLimits
from services.server.grpc_server import ServerOptions
from tests.support.polling import wait_until
from tests.support.raw_http2 import HeaderOnlyClient

RECEIVE_S = 2.0
PER_CONNECTION = 100
CONNECTIONS = 2                   # per server: 200 stalled streams on the gateway, 200 on the engine
MAX_RPCS = 8                      # far fewer seats than stalled calls: a stalled call must take none
DEADLINE_EXCEEDED = 4


def options(**overrides) -> ServerOptions:
    return ServerOptions(listen="127.0.0.1:0", max_concurrent_rpcs=MAX_RPCS, receive_timeout_s=RECEIVE_S,
                         connections=ConnectionLimits(max_streams_per_connection=2 * PER_CONNECTION), **overrides)


@pytest.fixture(scope="module")
def stack():
    s = ServeStack(EngineConfig(kv_capacity=4096), options(), engine_options=options()).start()
    with GatewayClient(s.address) as gateway:       # the gateway routes once its poll adopted the engine's model
        gateway.wait_until_serving(timeout_s=60)
    yield s
    s.stop()


def sample(stack: ServeStack, name: str, server: str) -> float:
    return stack.registry.get_sample_value(name, {"server": server}) or 0.0


def test_header_only_streams_lock_out_nothing_and_end_at_the_receive_timeout(stack):
    servers = {"ninfer-gateway-rpc": (stack.address, "/ninfer.v1.Gateway/Generate"),
               "ninfer-engine-rpc": (stack.engine.address, "/ninfer.v1.PrefillService/Prefill")}
    clients: dict[str, list[HeaderOnlyClient]] = {}
    opened_at = time.monotonic()
    for server, (address, path) in servers.items():
        clients[server] = [HeaderOnlyClient(address) for _ in range(CONNECTIONS)]
        for c in clients[server]:
            c.open(PER_CONNECTION, path)
    stalled = CONNECTIONS * PER_CONNECTION
    try:
        for server in servers:
            wait_until(lambda: sample(stack, "ninfer_rpc_awaiting_message", server) == stalled, RECEIVE_S,
                     f"{server}: {stalled} calls awaiting their message")
        with GatewayClient(stack.address) as gateway, \
                EngineClient(stack.engine.address, stack.engine_api_key) as engine:
            for _ in range(10):
                assert gateway.serving_status(timeout=1) == health_pb2.HealthCheckResponse.SERVING
                assert engine.serving_status(timeout=1) == health_pb2.HealthCheckResponse.SERVING
            *_, last = gateway.generate("still served", sampling=SamplingParams(max_tokens=4, ignore_eos=True),
                                        timeout=RECEIVE_S)
            assert last.result.stats.usage.completion_tokens == 4
            first = engine.prefill([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), timeout=RECEIVE_S)
            assert len(list(engine.decode(first.handle, timeout=RECEIVE_S))) >= 1
        served_at = time.monotonic()
        assert served_at - opened_at < RECEIVE_S, "everything above ran while the streams were stalled"
        for server in servers:
            assert sample(stack, "ninfer_rpc_active_calls", server) == 0, "a stalled call holds no seat"
            assert sample(stack, "ninfer_rpc_concurrency_limit", server) == MAX_RPCS

        every = [c for cs in clients.values() for c in cs]
        wait_until(lambda: sum(len(c.ends) for c in every) == len(servers) * stalled, RECEIVE_S + 5,
                 "every stalled stream ended")
        for c in every:
            assert {e.grpc_status for e in c.ends.values()} == {DEADLINE_EXCEEDED}
            assert "no request message within 2 s" in next(iter(c.ends.values())).message
            ends = [e.at - opened_at for e in c.ends.values()]
            assert RECEIVE_S - 0.2 <= min(ends) and max(ends) <= RECEIVE_S + 3.0, (min(ends), max(ends))
        for server in servers:      # the server counts a call out after the client has seen its end
            wait_until(lambda: sample(stack, "ninfer_rpc_awaiting_message", server) == 0, 5.0,
                     f"{server}: no call awaits its message")
            assert sample(stack, "ninfer_rpc_receive_timeouts_total", server) == stalled
    finally:
        for cs in clients.values():
            for c in cs:
                c.close()


def test_connections_are_capped_idle_ones_closed_and_the_stream_cap_announced():
    host = EngineHost(EngineConfig(kv_capacity=1024),
                      ServerOptions(listen="127.0.0.1:0", connections=ConnectionLimits(
                          max_streams_per_connection=7, max_connections=3, idle_timeout_s=1.0))).start()
    clients = []
    try:
        clients = [HeaderOnlyClient(host.address) for _ in range(3)]
        wait_until(lambda: clients[0].remote_max_streams() == 7, 5, "the server's SETTINGS announce the stream cap")
        extra = HeaderOnlyClient(host.address)
        clients.append(extra)
        wait_until(lambda: extra.closed, 5, "a connection past --max-connections is closed")
        assert not any(c.closed for c in clients[:3]), "the first three stay open"
        start = time.monotonic()
        wait_until(lambda: all(c.goaway or c.closed for c in clients[:3]), 6, "idle connections closed")
        assert time.monotonic() - start < 6
    finally:
        for c in clients:
            c.close()
        host.stop()
