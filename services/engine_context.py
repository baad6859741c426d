"""What the engine process's servicers share: the engine's front door and the server's parts.

The servicers take this, not the host that builds them, so that no servicer module imports the host
(one direction of imports: engine_host -> servicers -> engine_context)."""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.trace import Tracer

from engine.engine_info import EngineInfo
from engine.loop import EngineLoop
from services.server.lifecycle import ServingState
from services.server.prometheus import EnginePrometheus


@dataclass
class EngineContext:
    state: ServingState                    # health and drain; every call is admitted through it
    tracer: Tracer
    metrics: EnginePrometheus
    loop: EngineLoop | None = None         # the engine's front door, once loaded
    info: EngineInfo | None = None         # what it serves, once warm

    @property
    def engine(self) -> EngineLoop:
        """The loaded engine (callers are admitted only once it is serving)."""
        if self.loop is None:
            raise RuntimeError("the engine is not loaded")
        return self.loop
