"""The engines behind a gateway: their health, their model, and the least-loaded choice.

A poller checks each engine's grpc.health.v1 status every `poll_interval_s`. An engine takes
requests while it reports SERVING and serves the same tokenizer as the first engine seen (the
gateway tokenizes with it, so a mismatch would corrupt text). Load is the gateway's own count of
requests in flight per engine; ties go round robin.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.instrumentation.grpc import client_interceptor
from opentelemetry.instrumentation.grpc.grpcext import intercept_channel
from opentelemetry.sdk.trace import TracerProvider
from tokenizers import Tokenizer as HFTokenizer

from engine.tokenizer import Tokenizer
from ninfer.v1 import decode_pb2_grpc, engine_info_pb2, engine_info_pb2_grpc, prefill_pb2_grpc
from services.server.auth import bearer_metadata
from services.server.errors import RpcAbort
from services.server.tls import ClientTLS, open_channel

log = structlog.get_logger(__name__)
MODEL_INFO_MAX_BYTES = 256 * 1024 * 1024          # a large vocabulary's tokenizer.json is tens of MB
# Reconnect quickly after an engine outage: grpc's backoff otherwise grows to 120 s, and a restarted
# engine would wait that long for the gateway. Capped at 0.5 s (+ one health poll: back within 2 s).
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MODEL_INFO_MAX_BYTES),
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 500)]


@dataclass
class Engine:
    """One engine endpoint and its stubs. Decode goes over the bare channel: the gateway makes that
    client span itself, because the instrumentation's stream wrapper hides the call's cancel()."""

    address: str
    channel: grpc.Channel
    prefill: prefill_pb2_grpc.PrefillServiceStub
    decode: decode_pb2_grpc.DecodeServiceStub
    info: engine_info_pb2_grpc.EngineInfoServiceStub
    health: health_pb2_grpc.HealthStub
    serving: bool = False
    in_flight: int = 0
    model_info: engine_info_pb2.ModelInfo | None = None
    condition: str = "not checked yet"        # why it does not serve: down, warming up, draining...
    served: bool = False                      # it has served since it was last seen down

    @classmethod
    def connect(cls, address: str, tracer_provider: TracerProvider, tls: ClientTLS | None = None) -> "Engine":
        channel = open_channel(address, tls, options=CHANNEL_OPTIONS)
        traced = intercept_channel(channel, client_interceptor(tracer_provider=tracer_provider))
        return cls(address, channel, prefill_pb2_grpc.PrefillServiceStub(traced),
                   decode_pb2_grpc.DecodeServiceStub(channel), engine_info_pb2_grpc.EngineInfoServiceStub(channel),
                   health_pb2_grpc.HealthStub(channel))


@dataclass
class ServedModel:
    """What the gateway needs from the engines' ModelInfo: the tokenizer and the limits."""

    info: engine_info_pb2.ModelInfo
    tokenizer: Tokenizer = field(init=False)

    def __post_init__(self) -> None:
        self.tokenizer = Tokenizer(HFTokenizer.from_str(self.info.tokenizer_json), tuple(self.info.eos_token_ids))


class EngineRouter:
    def __init__(self, addresses: list[str], tracer_provider: TracerProvider, api_key: str | None = None,
                 poll_interval_s: float = 0.5, on_change: Callable[[bool], None] = lambda serving: None,
                 tls: ClientTLS | None = None):
        if not addresses:
            raise ValueError("a gateway needs at least one engine address")
        self.engines = [Engine.connect(a, tracer_provider, tls) for a in addresses]
        self.metadata = bearer_metadata(api_key)
        self.model: ServedModel | None = None
        self._poll_interval_s = poll_interval_s
        self._on_change = on_change
        self._lock = threading.Lock()
        self._next = 0                                   # round-robin start among equally loaded engines
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="ninfer-engine-health", daemon=True)

    def start(self) -> "EngineRouter":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:              # started (a failed start() never did)
            self._thread.join(timeout=5)
        for e in self.engines:
            e.channel.close()

    @property
    def any_serving(self) -> bool:
        return any(e.serving for e in self.engines)

    def why_not_serving(self) -> str:
        return "no engine is serving (" + ", ".join(f"{e.address}: {e.condition}" for e in self.engines) + ")"

    # -- routing --------------------------------------------------------------------------------

    def acquire(self, exclude: tuple[Engine, ...] = ()) -> Engine:
        """The least-loaded serving engine, its in-flight count taken; UNAVAILABLE when there is none."""
        with self._lock:
            n = len(self.engines)
            order = [self.engines[(self._next + i) % n] for i in range(n)]
            candidates = [e for e in order if e.serving and e not in exclude]
            if not candidates:
                raise RpcAbort(grpc.StatusCode.UNAVAILABLE, "no engine is serving")
            best = min(candidates, key=lambda e: e.in_flight)
            best.in_flight += 1
            self._next = (self.engines.index(best) + 1) % n
            return best

    def release(self, engine: Engine) -> None:
        with self._lock:
            engine.in_flight -= 1

    def mark_unavailable(self, engine: Engine) -> None:
        """A call found the engine down: stop routing to it until its health says otherwise."""
        self._set_serving(engine, False)

    def loads(self) -> list[tuple[str, bool, int]]:
        with self._lock:
            return [(e.address, e.serving, e.in_flight) for e in self.engines]

    # -- health ---------------------------------------------------------------------------------

    def _poll(self) -> None:
        while not self._stop.is_set():
            for engine in self.engines:
                self._set_serving(engine, self._check(engine))
            self._stop.wait(self._poll_interval_s)

    def _check(self, engine: Engine) -> bool:
        try:
            reply = engine.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
        except grpc.RpcError as e:
            engine.model_info = None                      # down: it may come back with another model
            engine.served = False
            engine.condition = f"down ({e.code().name})"
            return False
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            engine.condition = "draining" if engine.served else "warming up"
            return False
        engine.served = True
        engine.condition = "serving"
        if engine.model_info is None:
            try:
                engine.model_info = engine.info.GetModelInfo(
                    engine_info_pb2.GetModelInfoRequest(), timeout=30.0, metadata=self.metadata)
            except grpc.RpcError:
                return False
            return self._adopt(engine)
        return engine.model_info.tokenizer_sha256 == self.model.info.tokenizer_sha256

    def _adopt(self, engine: Engine) -> bool:
        """The first engine's model becomes the gateway's; later ones must share its tokenizer."""
        with self._lock:
            if self.model is None:
                self.model = ServedModel(engine.model_info)
                log.info("gateway_model", model=engine.model_info.model, engine=engine.address)
        if engine.model_info.tokenizer_sha256 == self.model.info.tokenizer_sha256:
            return True
        log.error("engine_tokenizer_mismatch", engine=engine.address, model=engine.model_info.model,
                  expected_model=self.model.info.model)
        engine.condition = f"serves another tokenizer ({engine.model_info.model})"
        return False

    def _set_serving(self, engine: Engine, serving: bool) -> None:
        with self._lock:
            before = self.any_serving
            changed = engine.serving != serving
            engine.serving = serving
            after = self.any_serving
        if changed:
            log.info("engine_health", engine=engine.address, serving=serving)
        if before != after or changed:
            self._on_change(after)
