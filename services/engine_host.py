"""The engine process: one EngineLoop behind PrefillService, DecodeService and EngineInfoService.

    host = EngineHost(EngineConfig(...), ServerOptions(listen="127.0.0.1:50052")).start()   # NOT_SERVING
    host.load()                   # build the engine, warm it up through the split path -> SERVING
    host.drain(); host.stop()     # SIGTERM: new prefills UNAVAILABLE, admitted requests finish

The server starts before the model loads so that health probes see NOT_SERVING (not a refused
connection) while weights load and the warm-up runs.
"""

from __future__ import annotations

import uuid

import structlog
from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.loop import EngineLoop
from engine.sampling_params import SamplingParams
from ninfer.v1 import decode_pb2, decode_pb2_grpc, engine_info_pb2, engine_info_pb2_grpc, prefill_pb2, \
    prefill_pb2_grpc
from services.decode import DecodeServicer
from services.engine_info import EngineInfoServicer, model_info
from services.prefill import PrefillServicer
from services.prometheus import EnginePrometheus
from services.server import NinferServer, ServerOptions

log = structlog.get_logger(__name__)
SERVICE_NAMES = [prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name,
                 decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name,
                 engine_info_pb2.DESCRIPTOR.services_by_name["EngineInfoService"].full_name]


class EngineHost(NinferServer):
    def __init__(self, config: EngineConfig, options: ServerOptions, registry: CollectorRegistry | None = None):
        super().__init__(options, SERVICE_NAMES, "loading the model", "ninfer-engine-rpc", registry)
        self.config = config
        self.lease_seconds: float | None = None     # the engine's, once loaded
        self.loop: EngineLoop | None = None
        self.model_info = None
        self.tracer = options.tracer_provider.get_tracer("ninfer.engine")
        self.metrics = EnginePrometheus(self.registry, self._snapshot_if_loaded)
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(self), self.server)
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(self), self.server)
        engine_info_pb2_grpc.add_EngineInfoServiceServicer_to_server(EngineInfoServicer(self), self.server)

    def start(self) -> "EngineHost":
        super().start()
        log.info("engine_listening", address=self.address, metrics_port=self.metrics_port)
        return self

    def load(self) -> "EngineHost":
        """Build the engine and warm it up; health turns SERVING after the warm-up request."""
        self.loop = EngineLoop(EngineCore(self.config)).start()
        self.lease_seconds = self.loop.core.scheduler.config.lease_s
        self.model_info = model_info(self.loop.core, self.lease_seconds)
        warm_up(self.loop)
        self.state.set_serving()
        log.info("engine_serving", address=self.address, **self.loop.core.describe())
        return self

    def drain(self) -> bool:
        """Refuse new prefills; wait (at most the drain timeout) until every admitted request is done."""
        log.info("engine_draining", address=self.address)
        return super().drain(busy=self._has_requests)

    def stop(self) -> None:
        super().stop()
        if self.loop is not None:
            self.loop.shutdown()
            if not self.loop.alive:                # its thread is out of the step: free every rank
                self.loop.core.shutdown()
        log.info("engine_stopped", address=self.address)

    def _has_requests(self) -> bool:
        return self.loop is not None and self.loop.alive and self.loop.call(lambda core: core.scheduler.num_unfinished) > 0

    def _snapshot_if_loaded(self):
        return self.loop.snapshot() if self.loop is not None and self.loop.alive else None


def warm_up(loop: EngineLoop) -> None:
    """One request through the prefill/decode split: every code path a served request takes runs once."""
    ids = loop.core.tokenizer.encode("warm up") or [0]
    stream = loop.submit(ids, SamplingParams(max_tokens=2, ignore_eos=True), f"warmup-{uuid.uuid4().hex}",
                         park_after_prefill=True)
    stream.next()
    for _ in loop.resume(stream.request_id):
        pass
