"""The gateway process: the public Gateway service in front of one or more engine processes.

    gw = GatewayServer(["127.0.0.1:50052"], ServerOptions(listen="127.0.0.1:50051")).start()
    ...                           # health SERVING once an engine serves (the router polls them)
    gw.drain(); gw.stop()         # SIGTERM: new calls UNAVAILABLE, streams in flight finish
"""

from __future__ import annotations

import structlog
from prometheus_client import CollectorRegistry

from ninfer.v1 import gateway_pb2, gateway_pb2_grpc
from services.server.prometheus import GatewayPrometheus
from engine.config import EngineConfig
from services.server.limits import admission_rpcs
from services.server.grpc_server import NinferServer, ServerOptions
from services.server.tls import ClientTLS
from gateway.migration import MigrationPolicy
from gateway.router import EngineRouter
from gateway.servicer import GatewayServicer

log = structlog.get_logger(__name__)
SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
DEFAULT_ENGINE = EngineConfig(device="cpu")      # only its admission defaults are read


class GatewayServer(NinferServer):
    def __init__(self, engines: list[str], options: ServerOptions, engine_api_key: str | None = None,
                 registry: CollectorRegistry | None = None, poll_interval_s: float = 0.5,
                 engine_tls: ClientTLS | None = None, engine_admission_rpcs: int | None = None,
                 migration: MigrationPolicy = MigrationPolicy()):
        """`engine_admission_rpcs`: calls one engine admits (services.server.limits.admission_rpcs); the
        default concurrency limit is that times the engines (the engine defaults when not given)."""
        per_engine = engine_admission_rpcs or admission_rpcs(DEFAULT_ENGINE.max_batch, DEFAULT_ENGINE.max_pending)
        super().__init__(options, [SERVICE_NAME], "no engine is serving", "ninfer-gateway-rpc", registry,
                         default_max_rpcs=per_engine * max(1, len(engines)))
        self._sized_by_flag = options.max_concurrent_rpcs is not None
        self._default_per_engine = per_engine
        self.router = EngineRouter(engines, options.tracer_provider, engine_api_key, poll_interval_s,
                                   on_change=self._engines_changed, tls=engine_tls)
        self.tracer = options.tracer_provider.get_tracer("ninfer.gateway")
        self.metrics = GatewayPrometheus(self.registry, self.router.loads)
        gateway_pb2_grpc.add_GatewayServicer_to_server(
            GatewayServicer(self.router, self.state, self.tracer, self.metrics, migration), self.server)

    def start(self) -> "GatewayServer":
        super().start()
        self.runtime.run(self.router.start())
        log.info("gateway_listening", address=self.address, engines=[e.address for e in self.router.engines],
                 metrics_port=self.metrics_port)
        return self

    def drain(self) -> bool:
        """Refuse new calls; wait (at most the drain timeout) for the streams in flight."""
        log.info("gateway_draining", address=self.address, in_flight=self.state.in_flight)
        return super().drain()

    def stop(self) -> None:
        if not self.runtime.loop.is_closed():
            self.runtime.run(self.server.stop(0))
            self.runtime.run(self.router.stop())
        super().stop()
        log.info("gateway_stopped", address=self.address)

    def _engines_changed(self, any_serving: bool) -> None:
        self._size_from_engines()
        self.state.set_serving(any_serving and self.router.model is not None, self.router.why_not_serving())

    def _size_from_engines(self) -> None:
        """Without --max-concurrent-rpcs the limit is what the engines admit, from their ModelInfo as
        they report it (an engine not heard from yet counts with the engine defaults)."""
        if self._sized_by_flag:
            return
        limit = sum(admission_rpcs(e.model_info.max_num_seqs, e.model_info.max_pending)
                    if e.model_info is not None and e.model_info.max_num_seqs else self._default_per_engine
                    for e in self.router.engines)
        if limit != self.limiter.limit:
            log.info("gateway_concurrency_limit", limit=limit, engines=len(self.router.engines))
            self.limiter.limit = limit
