"""Real processes: 32 concurrent streams through one gateway to two `ninfer engine` processes, and
`ninfer serve` draining on SIGTERM."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2

from gateway.client import GatewayClient, SamplingParams
from tools.serving.server_process import ServerProcess
from gateway.server import GatewayServer
from services.engine_client import EngineClient
from services.convert import stats_from_proto
from services.server.grpc_server import ServerOptions

CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}     # two engines share the CI machine's two cores
ENGINE_ARGS = ("--kv-capacity", "4096", "--max-pending", "64")


@pytest.fixture(scope="module")
def engines():
    procs = [ServerProcess.start("engine", *ENGINE_ARGS, env=CHILD_ENV) for _ in range(2)]
    try:
        yield procs
    finally:
        for p in procs:
            p.terminate()
        assert [p.wait() for p in procs] == [0, 0], "engines exit cleanly on SIGTERM"


def test_32_concurrent_streams_over_two_engine_processes_all_complete(engines):
    gateway = GatewayServer([p.address for p in engines], ServerOptions(listen="127.0.0.1:0"),
                            poll_interval_s=0.1).start()
    results, errors = [], []

    def one(i: int) -> None:
        try:
            *_, last = client.generate(f"stream {i}", sampling=SamplingParams(max_tokens=8, ignore_eos=True),
                                       timeout=120)
            results.append(last.result)
        except grpc.RpcError as e:
            errors.append(e)

    try:
        with GatewayClient(gateway.address) as client:
            client.wait_until_serving(timeout_s=60)
            while not all(e.serving for e in gateway.router.engines):     # both engines, not just the first
                time.sleep(0.05)
            threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(180)
        assert not errors, [(e.code(), e.details()) for e in errors[:3]]
        assert len(results) == 32
        assert all(r.stats.usage.completion_tokens == 8 and stats_from_proto(r.stats).finish_reason == "length"
                   for r in results)
        served = Counter(r.engine for r in results)
        assert set(served) == {p.address for p in engines}, f"least-loaded routing used both engines: {served}"
        assert [n for _, _, n in gateway.router.loads()] == [0, 0] and gateway.state.in_flight == 0
        for p in engines:
            with EngineClient(p.address) as engine:
                m = engine.wait_idle()
                assert m.kv.free_blocks == m.kv.num_blocks, f"{p.address} holds KV after the streams"
                assert m.kv.refs_taken == m.kv.refs_dropped
                assert m.performance.requests["length"] == served[p.address]   # the warm-up leaves no trace
                assert "abort" not in m.performance.requests
    finally:
        gateway.stop()


def test_serve_drains_on_sigterm():
    with ServerProcess.start("serve", "--kv-capacity", "4096", "--drain-timeout", "120", env=CHILD_ENV) as serve:
        with GatewayClient(serve.address) as client:
            client.wait_until_serving(timeout_s=120)
            call = client.generate("drain", sampling=SamplingParams(max_tokens=400, ignore_eos=True),
                                   include_token_ids=True)
            tokens = len(next(call).token_ids)
            serve.terminate()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    if client.serving_status() == health_pb2.HealthCheckResponse.NOT_SERVING:
                        break
                except grpc.RpcError:
                    break
                time.sleep(0.01)
            with pytest.raises(grpc.RpcError) as refused:
                list(client.generate("too late", sampling=SamplingParams(max_tokens=2)))
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            for msg in call:                          # the stream in flight finishes
                tokens += len(msg.token_ids)
            assert tokens == 400 and stats_from_proto(msg.result.stats).finish_reason == "length"
        assert serve.wait(60) == 0
    names = [e["event"] for e in serve.events]
    assert names.index("gateway_draining") < names.index("gateway_stopped")
    assert "engine_draining" in names
