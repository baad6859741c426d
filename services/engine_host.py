"""The engine process: one EngineLoop behind PrefillService, DecodeService and EngineInfoService.

    host = EngineHost(EngineConfig(...), ServerOptions(listen="127.0.0.1:50052")).start()   # NOT_SERVING
    host.load()                   # build the engine, run its warm-up (graphs captured) -> SERVING
    host.drain(); host.stop()     # SIGTERM: new prefills UNAVAILABLE, admitted requests finish

The server starts before the model loads so that health probes see NOT_SERVING (not a refused
connection) while weights load and the warm-up runs.
"""

from __future__ import annotations

import structlog
from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.loop import EngineLoop
from ninfer.v1 import decode_pb2, decode_pb2_grpc, engine_info_pb2, engine_info_pb2_grpc, prefill_pb2, \
    prefill_pb2_grpc
from services.decode import DecodeServicer
from services.engine_context import EngineContext
from services.engine_info import EngineInfoServicer
from services.prefill import PrefillServicer
from services.server.prometheus import EnginePrometheus
from services.server.limits import admission_rpcs
from services.server.grpc_server import NinferServer, ServerOptions
from services.smg import add_smg_services

log = structlog.get_logger(__name__)
SERVICE_NAMES = [prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name,
                 decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name,
                 engine_info_pb2.DESCRIPTOR.services_by_name["EngineInfoService"].full_name]


class EngineHost(NinferServer):
    def __init__(self, config: EngineConfig, options: ServerOptions, registry: CollectorRegistry | None = None):
        super().__init__(options, SERVICE_NAMES, "loading the model", "ninfer-engine-rpc", registry,
                         default_max_rpcs=admission_rpcs(config.max_batch, config.max_pending))
        self.config = config
        self.ctx = EngineContext(self.state, options.tracer_provider.get_tracer("ninfer.engine"),
                                 EnginePrometheus(self.registry, self._metrics_if_loaded))
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(self.ctx), self.server)
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(self.ctx), self.server)
        engine_info_pb2_grpc.add_EngineInfoServiceServicer_to_server(EngineInfoServicer(self.ctx), self.server)
        self.smg = add_smg_services(self.ctx, self.server, self.service_names, config)   # services/smg

    @property
    def loop(self) -> EngineLoop | None:
        return self.ctx.loop

    def start(self) -> "EngineHost":
        super().start()
        log.info("engine_listening", address=self.address, metrics_port=self.metrics_port)
        return self

    def load(self) -> "EngineHost":
        """Build the engine and warm it up (`EngineCore.warmup`: every kernel, the CUDA graphs);
        health turns SERVING only after that."""
        from engine.core import EngineCore               # torch: only the engine process loads it
        self.state.set_serving(False, "loading the model")
        loop = EngineLoop(EngineCore(self.config)).start()
        self.ctx.loop = loop
        self.state.set_serving(False, "warming up (compiling kernels, capturing CUDA graphs)")
        log.info("engine_warming_up", address=self.address)
        loop.warmup()
        self.ctx.info = loop.info()
        self.state.set_serving()
        log.info("engine_serving", address=self.address, **self.ctx.info.log_fields())
        return self

    def drain(self) -> bool:
        """Refuse new prefills; wait (at most the drain timeout) until every admitted request is done."""
        log.info("engine_draining", address=self.address)
        return super().drain(busy=self._has_requests)

    def stop(self) -> None:
        super().stop()
        self.smg.pd.close()               # a producer's or consumer's NIXL agent (its UCX progress thread) goes
        loop = self.ctx.loop
        if loop is not None:
            loop.shutdown()
        log.info("engine_stopped", address=self.address)

    def _has_requests(self) -> bool:
        loop = self.ctx.loop
        return loop is not None and loop.alive and loop.num_unfinished() > 0

    def _metrics_if_loaded(self):
        loop = self.ctx.loop
        return loop.metrics() if loop is not None and loop.alive else None
