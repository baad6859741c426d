"""What the engine process and the gateway share: server options, and a `grpc.aio` server with the
interceptor chain (receive timeout, tracing, concurrency limit, auth, error mapping), health and
drain, TLS/mTLS, optional reflection, metrics, and the limits of its connections.

Why grpc.aio (the asyncio server, which vLLM's and SGLang's gRPC servers also run on): a call is a
coroutine, so a call that waits (for its request message, an engine step, a slow reader) holds no
thread; the sync server gave each call a pool thread, and a few hundred header-only streams took
them all (health included). The public API stays synchronous (services.server.event_loop).

Drain is bounded by `drain_timeout_s` in total: new calls are refused at once; the calls in flight
get until a moment before the timeout, then they are cut (each ends UNAVAILABLE saying the server
shut down) and the server stops at the timeout."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from services.server.address import join_host_port, split_host_port
from services.server.auth import BearerTokenInterceptor
from services.server.connections import ConnectionLimits, channel_options
from services.server.errors import ErrorMappingInterceptor
from services.server.event_loop import EventLoopThread
from services.server.lifecycle import ServingState
from services.server.limits import ConcurrencyLimitInterceptor
from services.server.metrics import ServerMetrics
from services.server.prometheus import serve_metrics
from services.server.receive import ReceiveTimeoutInterceptor
from services.server.tls import ServerTLS, is_loopback, warn_if_not_valid_now

log = structlog.get_logger(__name__)
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024     # gRPC's default receive limit
# grpc itself refuses (without pushback, unread) a message past this multiple of --max-message-bytes;
# between the two the server refuses it with retry pushback
TRANSPORT_MESSAGE_FACTOR = 2
CUT_BEFORE_S = 1.0      # calls still running this long before the drain timeout are cut


@dataclass
class ServerOptions:
    """Flags every ninfer server takes (see ninfer/cli/flags.py for their spelling)."""

    listen: str                                     # HOST:PORT; port 0 = any free port
    metrics_listen: str | None = None               # HOST:PORT of /metrics; None = off
    api_key: str | None = field(default=None, repr=False)   # bearer token every call but health must present
    enable_reflection: bool = False
    max_concurrent_rpcs: int | None = None          # None = sized from the engines' admission
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    retry_pushback_ms: int = 1000                   # grpc-retry-pushback-ms on RESOURCE_EXHAUSTED
    drain_timeout_s: float = 30.0                   # SIGTERM to stopped, in total
    tls: ServerTLS | None = None                    # None = plaintext
    tracer_provider: TracerProvider = field(default_factory=TracerProvider)
    receive_timeout_s: float = 10.0                 # a call's request message must arrive within this
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)


class NinferServer:
    """A grpc.aio server with the interceptor chain, health (NOT_SERVING until `state.set_serving()`),
    drain, optional reflection, and a Prometheus registry served at `options.metrics_listen`.
    The engine process and the gateway are subclasses; each registers its servicers on `server`
    (registration is synchronous; the servicers' methods are coroutines run on `runtime`)."""

    def __init__(self, options: ServerOptions, service_names: list[str], not_ready_reason: str, name: str,
                 registry: CollectorRegistry | None = None, default_max_rpcs: int = 400):
        self.options = options
        self.name = name
        self.service_names = service_names
        self.runtime = EventLoopThread(name)
        self.state = ServingState(service_names, self.runtime, not_ready_reason)
        self.registry = registry or CollectorRegistry()
        self.server_metrics = ServerMetrics(self.registry, name)
        # Only the request path is traced: a span per health probe, reflection or Get* (model info,
        # metrics) call would bury the requests.
        untraced = filters.any_of(filters.service_prefix("grpc."), filters.method_prefix("Get"))
        self.max_concurrent_rpcs = options.max_concurrent_rpcs or default_max_rpcs
        self.limiter = ConcurrencyLimitInterceptor(self.max_concurrent_rpcs, options.retry_pushback_ms,
                                                   self.server_metrics.refused)
        self.receiver = ReceiveTimeoutInterceptor(options.receive_timeout_s, self.server_metrics)
        interceptors = [self.receiver,
                        aio_server_interceptor(tracer_provider=options.tracer_provider,
                                               filter_=filters.negate(untraced)),
                        self.limiter]
        if options.api_key:
            interceptors.append(BearerTokenInterceptor(options.api_key))
        interceptors.append(ErrorMappingInterceptor(options.retry_pushback_ms, options.max_message_bytes))
        self.server_metrics.watch(active=lambda: self.limiter.active, limit=lambda: self.limiter.limit,
                                  awaiting=lambda: self.receiver.awaiting)
        transport = [("grpc.max_receive_message_length", TRANSPORT_MESSAGE_FACTOR * options.max_message_bytes),
                     ("grpc.so_reuseport", 0)]
        self.server = self.runtime.run(self._create(
            interceptors, transport + channel_options(options.connections, self.max_concurrent_rpcs)))
        health_pb2_grpc.add_HealthServicer_to_server(self.state.health, self.server)
        host, _ = split_host_port(options.listen)
        try:
            if options.tls is not None:
                warn_if_not_valid_now(options.tls)
                port = self.server.add_secure_port(options.listen, options.tls.credentials())
            else:
                port = self.server.add_insecure_port(options.listen)
        except RuntimeError as e:                 # grpc's "Failed to bind to address"
            self.runtime.close()
            raise OSError(f"cannot listen on {options.listen}: {e}") from None
        self.address = join_host_port(host, port)
        if not is_loopback(host):
            if options.tls is None:
                log.warning("listening_without_tls", address=self.address,
                            hint="traffic and bearer tokens cross the network in plaintext: pass --tls-cert/--tls-key")
            if not options.api_key and not (options.tls and options.tls.client_ca):
                log.warning("listening_without_authentication", address=self.address,
                            hint="anyone who reaches this address may call it: set NINFER_API_KEY_FILE "
                                 "(or --api-key-file) or --tls-client-ca")
        self.metrics_port: int | None = None
        self._metrics_server = None

    @staticmethod
    async def _create(interceptors: list, options: list) -> grpc.aio.Server:
        # no maximum_concurrent_rpcs: grpc's own would count calls still waiting for their message
        return grpc.aio.server(interceptors=interceptors, options=options)

    def start(self) -> None:
        if self.options.enable_reflection:
            reflection.enable_server_reflection(
                [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.runtime.run(self.server.start())
        if self.options.metrics_listen:
            self._metrics_server, self.metrics_port = serve_metrics(self.options.metrics_listen, self.registry)

    def drain(self, busy: Callable[[], bool] = lambda: False) -> bool:
        """Refuse new calls (UNAVAILABLE, health NOT_SERVING), wait for the calls in flight (and for
        `busy()` to turn false); cut what still runs shortly before the drain timeout; stop at the
        timeout at the latest. True when everything finished before the cut."""
        timeout = self.options.drain_timeout_s
        deadline = time.monotonic() + timeout
        self.state.drain()
        idle = self.state.wait_idle(max(0.0, timeout - min(CUT_BEFORE_S, timeout / 4)), busy)
        if not idle:
            log.warning("drain_timeout_cut", in_flight=self.state.in_flight, drain_timeout_s=timeout)
            self.state.cut()
            self.state.wait_idle(max(0.0, deadline - time.monotonic()))
        # the handlers returned; their last messages and status go out within what is left
        left = max(0.0, deadline - time.monotonic())
        self.runtime.run(self.server.stop(left), timeout_s=left + 10.0)
        return idle

    def stop(self) -> None:
        if not self.runtime.loop.is_closed():
            self.runtime.run(self.server.stop(0))
            self.runtime.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
