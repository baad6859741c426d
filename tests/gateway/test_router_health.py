"""The gateway's health poller (gateway/router.py) against real grpc.health.v1 servers on 127.0.0.1: an engine
that answers late stays routed until MISSED_PROBES_DOWN checks in a row time out; one that refuses the
connection is down at the first check."""

from __future__ import annotations

import asyncio
import socket

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider

from gateway.router import MISSED_PROBES_DOWN, EngineRouter

TIMEOUT_S = 0.2


class SlowHealth(health.aio.HealthServicer):
    """A health servicer that answers after `delay_s` (a host too loaded to answer in time)."""

    def __init__(self) -> None:
        super().__init__()
        self.delay_s = 0.0

    async def Check(self, request, context):
        await asyncio.sleep(self.delay_s)
        return await super().Check(request, context)


async def _slow_engine() -> tuple[grpc.aio.Server, SlowHealth, str]:
    server = grpc.aio.server()
    servicer = SlowHealth()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, servicer, f"127.0.0.1:{port}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_late_answers_keep_a_serving_engine_until_the_limit_and_an_answer_resets_the_count():
    async def run() -> None:
        server, servicer, address = await _slow_engine()
        router = EngineRouter([address], TracerProvider(), health_timeout_s=TIMEOUT_S)
        engine = router.engines[0]
        engine.connect(None)
        try:
            engine.serving = True                          # as after it served (model adopted)
            servicer.delay_s = 5 * TIMEOUT_S
            seen = [await router._check(engine) for _ in range(MISSED_PROBES_DOWN - 1)]
            assert seen == [True] * (MISSED_PROBES_DOWN - 1)
            assert engine.condition == f"serving (missed {MISSED_PROBES_DOWN - 1} health check(s))"
            servicer.delay_s = 0.0
            assert await engine.probe(TIMEOUT_S) == health_pb2.HealthCheckResponse.SERVING
            assert engine.missed_probes == 0
            servicer.delay_s = 5 * TIMEOUT_S
            seen = [await router._check(engine) for _ in range(MISSED_PROBES_DOWN)]
            assert seen == [True] * (MISSED_PROBES_DOWN - 1) + [False]
            assert engine.condition == "down (not answering)"
        finally:
            await engine.channel.close()
            await server.stop(None)

    asyncio.run(run())


def test_a_refused_connection_is_down_at_the_first_check():
    async def run() -> None:
        router = EngineRouter([f"127.0.0.1:{_free_port()}"], TracerProvider(), health_timeout_s=TIMEOUT_S)
        engine = router.engines[0]
        engine.connect(None)
        try:
            engine.serving = True
            assert await router._check(engine) is False
            assert engine.condition == "down (not answering)" and engine.missed_probes == MISSED_PROBES_DOWN
        finally:
            await engine.channel.close()

    asyncio.run(run())
