"""`ninfer serve`: an engine process and a gateway in one process, talking gRPC over loopback.

The engine listens on a free loopback port with a random bearer token, so that the split (and its
traces and errors) is the same as with separate processes, and nothing else on the host can drive
the engine directly. One /metrics endpoint serves both registries.
"""

from __future__ import annotations

import secrets
from dataclasses import replace

import structlog
from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from services.engine_host import EngineHost
from services.prometheus import serve_metrics
from services.server import ServerOptions
from gateway.server import GatewayServer

log = structlog.get_logger(__name__)


class ServeStack:
    def __init__(self, config: EngineConfig, options: ServerOptions, engine_options: ServerOptions | None = None):
        """`options` configure the public gateway; the engine gets loopback defaults unless given."""
        self.registry = CollectorRegistry()
        self.engine_api_key = engine_key = secrets.token_urlsafe(24)
        engine_options = engine_options or replace(options, listen="127.0.0.1:0", enable_reflection=False)
        self.engine = EngineHost(config, replace(engine_options, metrics_listen=None, api_key=engine_key),
                                 registry=self.registry)
        self.gateway = GatewayServer([self.engine.address], replace(options, metrics_listen=None),
                                     engine_api_key=engine_key, registry=self.registry)
        self._metrics_listen = options.metrics_listen
        self._metrics_server = None
        self.metrics_port: int | None = None

    @property
    def address(self) -> str:
        return self.gateway.address

    def start(self) -> "ServeStack":
        """Listen at once (health NOT_SERVING), load and warm the engine, then route to it."""
        self.engine.start()
        self.gateway.start()
        if self._metrics_listen:
            self._metrics_server, self.metrics_port = serve_metrics(self._metrics_listen, self.registry)
            log.info("metrics_listening", port=self.metrics_port)
        self.engine.load()
        return self

    def drain(self) -> bool:
        """The gateway's streams finish first; then the engine has nothing left."""
        drained = self.gateway.drain()
        return self.engine.drain() and drained

    def stop(self) -> None:
        self.gateway.stop()
        self.engine.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
