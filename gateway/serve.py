"""`ninfer serve`: an engine process and a gateway in one process, talking gRPC over loopback.

The engine listens on a free loopback port with a random bearer token, so that the split (and its
traces and errors) is the same as with separate processes, and nothing else on the host can drive
the engine directly; that hop stays plaintext (the TLS flags are the gateway's). One /metrics
endpoint (the gateway's) serves both. A drain drains both at once, within one --drain-timeout.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import replace

from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from services.engine_host import EngineHost
from services.server.limits import admission_rpcs
from services.server.grpc_server import ServerOptions
from gateway.server import GatewayServer


class ServeStack:
    def __init__(self, config: EngineConfig, options: ServerOptions, engine_options: ServerOptions | None = None):
        """`options` configure the public gateway; the engine gets loopback defaults unless given.
        Both share one registry, so the gateway's /metrics endpoint serves the engine's metrics too."""
        registry = CollectorRegistry()
        self.engine_api_key = engine_key = secrets.token_urlsafe(24)
        engine_options = engine_options or replace(options, listen="127.0.0.1:0", enable_reflection=False, tls=None,
                                                   max_concurrent_rpcs=None)
        self.engine = EngineHost(config, replace(engine_options, metrics_listen=None, api_key=engine_key),
                                 registry=registry)
        self.gateway = GatewayServer([self.engine.address], options, engine_api_key=engine_key, registry=registry,
                                     engine_admission_rpcs=admission_rpcs(config.max_batch, config.max_pending))
        self.registry = registry

    @property
    def address(self) -> str:
        return self.gateway.address

    @property
    def metrics_port(self) -> int | None:
        return self.gateway.metrics_port

    def start(self) -> "ServeStack":
        """Listen at once (health NOT_SERVING), load and warm the engine, then route to it."""
        self.engine.start()
        self.gateway.start()
        self.engine.load()
        return self

    def drain(self) -> bool:
        """Both at once, each within the drain timeout (the engine serves the gateway's decode streams
        while it drains: a decode of admitted work passes)."""
        result: dict[str, bool] = {}
        engine = threading.Thread(target=lambda: result.update(engine=self.engine.drain()), name="ninfer-engine-drain")
        engine.start()
        gateway = self.gateway.drain()
        engine.join()
        return gateway and result.get("engine", False)

    def stop(self) -> None:
        self.gateway.stop()
        self.engine.stop()
