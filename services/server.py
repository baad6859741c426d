"""What the engine process and the gateway share: server options, and a server with the gRPC
interceptor chain (tracing, auth, error mapping), health and drain, optional reflection, metrics."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.instrumentation.grpc import filters, server_interceptor
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from services.address import join_host_port, split_host_port
from services.auth import BearerTokenInterceptor
from services.errors import ErrorMappingInterceptor
from services.lifecycle import ServingState
from services.prometheus import serve_metrics

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024     # gRPC's default receive limit
SEND_GRACE_S = 5.0      # a handler that returned may still be sending its last messages and status


@dataclass
class ServerOptions:
    """Flags every ninfer server takes (see ninfer/cli/flags.py for their spelling)."""

    listen: str                                     # HOST:PORT; port 0 = any free port
    metrics_listen: str | None = None               # HOST:PORT of /metrics; None = off
    api_key: str | None = None                      # bearer token every call but health must present
    enable_reflection: bool = False
    max_workers: int = 256                          # threads: one per open stream
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    retry_pushback_ms: int = 1000                   # grpc-retry-pushback-ms on RESOURCE_EXHAUSTED
    drain_timeout_s: float = 30.0                   # grace for streams in flight on SIGTERM
    tracer_provider: TracerProvider = field(default_factory=TracerProvider)


class NinferServer:
    """A gRPC server with the interceptor chain, health (NOT_SERVING until `state.set_serving()`),
    drain, optional reflection, and a Prometheus registry served at `options.metrics_listen`.
    The engine process and the gateway are subclasses; each registers its servicers on `server`."""

    def __init__(self, options: ServerOptions, service_names: list[str], not_ready_reason: str, name: str,
                 registry: CollectorRegistry | None = None):
        self.options = options
        self.service_names = service_names
        self.state = ServingState(service_names, not_ready_reason)
        self.registry = registry or CollectorRegistry()
        # Only the request path is traced: a span per health probe, reflection or Get* (model info,
        # metrics) call would bury the requests.
        untraced = filters.any_of(filters.service_prefix("grpc."), filters.method_prefix("Get"))
        interceptors = [server_interceptor(tracer_provider=options.tracer_provider, filter_=filters.negate(untraced))]
        if options.api_key:
            interceptors.append(BearerTokenInterceptor(options.api_key))
        interceptors.append(ErrorMappingInterceptor(options.retry_pushback_ms))
        self.server = grpc.server(
            ThreadPoolExecutor(options.max_workers, thread_name_prefix=name), interceptors=interceptors,
            options=[("grpc.max_receive_message_length", options.max_message_bytes),
                     ("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.state.health, self.server)
        host, _ = split_host_port(options.listen)
        try:
            port = self.server.add_insecure_port(options.listen)
        except RuntimeError as e:                 # grpc's "Failed to bind to address"
            raise OSError(f"cannot listen on {options.listen}: {e}") from None
        self.address = join_host_port(host, port)
        self.metrics_port: int | None = None
        self._metrics_server = None

    def start(self) -> None:
        if self.options.enable_reflection:
            reflection.enable_server_reflection(
                [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.server.start()
        if self.options.metrics_listen:
            self._metrics_server, self.metrics_port = serve_metrics(self.options.metrics_listen, self.registry)

    def drain(self, busy: Callable[[], bool] = lambda: False) -> bool:
        """Refuse new calls (UNAVAILABLE, health NOT_SERVING), wait up to the drain timeout for the calls
        in flight (and for `busy()` to turn false), then let their last messages and status go out
        before the server stops listening. True when everything finished in time."""
        self.state.drain()
        idle = self.state.wait_idle(self.options.drain_timeout_s, busy)
        self.server.stop(SEND_GRACE_S).wait()
        return idle

    def stop(self) -> None:
        self.server.stop(0).wait()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
