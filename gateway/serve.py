"""`ninfer serve`: an engine process and a gateway in one process, talking gRPC over loopback.

The engine listens on a free loopback port with a random bearer token, so that the split (and its
traces and errors) is the same as with separate processes, and nothing else on the host can drive
the engine directly. One /metrics endpoint (the gateway's) serves both.
"""

from __future__ import annotations

import secrets
from dataclasses import replace

from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from services.engine_host import EngineHost
from services.server import ServerOptions
from gateway.server import GatewayServer


class ServeStack:
    def __init__(self, config: EngineConfig, options: ServerOptions, engine_options: ServerOptions | None = None):
        """`options` configure the public gateway; the engine gets loopback defaults unless given.
        Both share one registry, so the gateway's /metrics endpoint serves the engine's metrics too."""
        registry = CollectorRegistry()
        self.engine_api_key = engine_key = secrets.token_urlsafe(24)
        engine_options = engine_options or replace(options, listen="127.0.0.1:0", enable_reflection=False)
        self.engine = EngineHost(config, replace(engine_options, metrics_listen=None, api_key=engine_key),
                                 registry=registry)
        self.gateway = GatewayServer([self.engine.address], options, engine_api_key=engine_key, registry=registry)
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
        """The gateway's streams finish first; then the engine has nothing left."""
        drained = self.gateway.drain()
        return self.engine.drain() and drained

    def stop(self) -> None:
        self.gateway.stop()
        self.engine.stop()
