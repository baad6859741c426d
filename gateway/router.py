"""The engines behind a gateway: their health, their model, and the least-loaded choice.

A poller (a task on the gateway's event loop) checks every engine's grpc.health.v1 status every
`poll_interval_s`, all at once. An engine takes requests while it reports SERVING and serves the
same tokenizer as the first engine seen (the gateway tokenizes with it, so a mismatch would corrupt
text). Load is the gateway's own count of requests in flight per engine; ties go round robin. The
channels are grpc.aio channels of the gateway's event loop (made in `start()`, on that loop).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from tokenizers import Tokenizer as HFTokenizer

from engine.tokenizer import Tokenizer
from ninfer.v1 import decode_pb2_grpc, engine_info_pb2, engine_info_pb2_grpc, prefill_pb2_grpc
from services.server.auth import bearer_metadata
from services.server.errors import RpcAbort
from services.server.tls import ClientTLS, open_aio_channel

log = structlog.get_logger(__name__)
MODEL_INFO_MAX_BYTES = 256 * 1024 * 1024          # a large vocabulary's tokenizer.json is tens of MB
# Reconnect quickly after an engine outage: grpc's backoff otherwise grows to 120 s, and a restarted
# engine would wait that long for the gateway. Capped at 0.5 s (+ one health poll: back within 2 s).
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MODEL_INFO_MAX_BYTES),
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 500)]
HEALTH_TIMEOUT_S = 2.0
# An engine whose health check times out is busy or hung; one that refuses the connection is down. A loaded
# host can miss one 2 s check (the CI machine did, with 200 stalled streams on it and a test beside it), so
# only this many consecutive timeouts mark it down; a refusal marks it down at once, as a failed call does.
MISSED_PROBES_DOWN = 3


@dataclass
class Engine:
    """One engine endpoint, its channel and stubs (from `connect`, on the gateway's event loop)."""

    address: str
    channel: grpc.aio.Channel | None = None
    prefill: prefill_pb2_grpc.PrefillServiceStub | None = None
    decode: decode_pb2_grpc.DecodeServiceStub | None = None
    info: engine_info_pb2_grpc.EngineInfoServiceStub | None = None
    health: health_pb2_grpc.HealthStub | None = None
    serving: bool = False
    in_flight: int = 0
    model_info: engine_info_pb2.ModelInfo | None = None
    condition: str = "not checked yet"        # why it does not serve: down, warming up, draining...
    served: bool = False                      # it has served since it was last seen down
    missed_probes: int = 0                    # consecutive health checks it did not answer in time

    def connect(self, tls: ClientTLS | None = None) -> None:
        # no tracing interceptor: the gateway makes its client spans itself (gateway.client_spans says why)
        self.channel = open_aio_channel(self.address, tls, options=CHANNEL_OPTIONS)
        self.prefill = prefill_pb2_grpc.PrefillServiceStub(self.channel)
        self.decode = decode_pb2_grpc.DecodeServiceStub(self.channel)
        self.info = engine_info_pb2_grpc.EngineInfoServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def probe(self, timeout_s: float = HEALTH_TIMEOUT_S) -> int | None:
        """The engine's health status now; None when it does not answer within `timeout_s` (`missed_probes`
        counts consecutive timeouts; a refused or broken call sets it to MISSED_PROBES_DOWN: down at once)."""
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError as e:
            late = e.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            self.missed_probes = self.missed_probes + 1 if late else MISSED_PROBES_DOWN
            return None
        self.missed_probes = 0
        return reply.status


@dataclass
class ServedModel:
    """What the gateway needs from the engines' ModelInfo: the tokenizer and the limits."""

    info: engine_info_pb2.ModelInfo
    tokenizer: Tokenizer = field(init=False)
    max_token_bytes: int = field(init=False)     # the most UTF-8 bytes one token stands for (a bound, see prepare)

    def __post_init__(self) -> None:
        self.tokenizer = Tokenizer(HFTokenizer.from_str(self.info.tokenizer_json), tuple(self.info.eos_token_ids))
        self.max_token_bytes = self.tokenizer.max_token_bytes()


class EngineRouter:
    def __init__(self, addresses: list[str], tracer_provider: TracerProvider, api_key: str | None = None,
                 poll_interval_s: float = 0.5, on_change: Callable[[bool], None] = lambda serving: None,
                 tls: ClientTLS | None = None, health_timeout_s: float = HEALTH_TIMEOUT_S):
        if not addresses:
            raise ValueError("a gateway needs at least one engine address")
        self.engines = [Engine(a) for a in addresses]
        self.metadata = bearer_metadata(api_key)
        self.model: ServedModel | None = None
        self._tracer_provider = tracer_provider
        self._tls = tls
        self._poll_interval_s = poll_interval_s
        self._health_timeout_s = health_timeout_s
        self._on_change = on_change
        self._lock = threading.Lock()
        self._next = 0                                   # round-robin start among equally loaded engines
        self._poller: asyncio.Task | None = None

    async def start(self) -> "EngineRouter":
        """On the gateway's event loop: connect the channels and start polling."""
        for engine in self.engines:
            engine.connect(self._tls)
        self._poller = asyncio.get_running_loop().create_task(self._poll())
        return self

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        for e in self.engines:
            if e.channel is not None:
                await e.channel.close()

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

    def mark_unavailable(self, engine: Engine, condition: str = "down (a call found it unavailable)") -> None:
        """A call found the engine down: stop routing to it until its health says otherwise."""
        changed = engine.condition != condition
        engine.condition = condition
        self._set_serving(engine, False, condition_changed=changed)

    def loads(self) -> list[tuple[str, bool, int]]:
        with self._lock:
            return [(e.address, e.serving, e.in_flight) for e in self.engines]

    # -- health ---------------------------------------------------------------------------------

    async def _poll(self) -> None:
        while True:
            await asyncio.gather(*(self._poll_one(e) for e in self.engines))
            await asyncio.sleep(self._poll_interval_s)

    async def _poll_one(self, engine: Engine) -> None:
        condition = engine.condition
        serving = await self._check(engine)
        self._set_serving(engine, serving, condition_changed=engine.condition != condition)

    async def _check(self, engine: Engine) -> bool:
        status = await engine.probe(self._health_timeout_s)
        if status is None and engine.serving and engine.missed_probes < MISSED_PROBES_DOWN:
            engine.condition = f"serving (missed {engine.missed_probes} health check(s))"
            return True
        if status is None:
            engine.model_info = None                      # down: it may come back with another model
            engine.served = False
            engine.condition = "down (not answering)"
            return False
        if status != health_pb2.HealthCheckResponse.SERVING:
            engine.condition = "draining" if engine.served else "warming up"
            return False
        engine.served = True
        engine.condition = "serving"
        if engine.model_info is None:
            try:
                engine.model_info = await engine.info.GetModelInfo(
                    engine_info_pb2.GetModelInfoRequest(), timeout=30.0, metadata=self.metadata)
            except grpc.RpcError:
                return False
            return await self._adopt(engine)
        return engine.model_info.tokenizer_sha256 == self.model.info.tokenizer_sha256

    async def _adopt(self, engine: Engine) -> bool:
        """The first engine's model becomes the gateway's; later ones must share its tokenizer."""
        if self.model is None:
            model = await asyncio.to_thread(ServedModel, engine.model_info)    # a large tokenizer takes a while
            with self._lock:
                if self.model is None:
                    self.model = model
                    log.info("gateway_model", model=engine.model_info.model, engine=engine.address)
        if engine.model_info.tokenizer_sha256 == self.model.info.tokenizer_sha256:
            return True
        log.error("engine_tokenizer_mismatch", engine=engine.address, model=engine.model_info.model,
                  expected_model=self.model.info.model)
        engine.condition = f"serves another tokenizer ({engine.model_info.model})"
        return False

    def _set_serving(self, engine: Engine, serving: bool, condition_changed: bool = False) -> None:
        with self._lock:
            before = self.any_serving
            changed = engine.serving != serving
            engine.serving = serving
            after = self.any_serving
        if changed:
            log.info("engine_health", engine=engine.address, serving=serving, condition=engine.condition)
        # a new condition changes the gateway's not-serving reason even when no flag flips (an engine
        # that was draining and has now exited is "down", not "draining")
        if before != after or changed or condition_changed:
            self._on_change(after)
