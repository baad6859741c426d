"""The engine's error types. Each maps to one gRPC status in services/ (docs/architecture.md, "Error model")."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidArgumentError(EngineError, ValueError):
    """A request or configuration field is out of range. Never enqueued.

    `field` names the offending field so that callers (the gRPC layer, the CLI) can point at it.
    """

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class UnsupportedError(EngineError):
    """This engine cannot do what the request asks (an embedding of a generative model, structured
    output without its grammar engine installed): UNIMPLEMENTED, with what would make it work."""


class CapacityError(EngineError):
    """The configuration cannot fit in memory; raised before any weight is loaded."""


class ModelLoadError(EngineError):
    """A checkpoint is unreadable, of an unsupported type, or its tensors do not match."""


class QueueFullError(EngineError):
    """The pending queue holds `max_pending` requests already; refused at once."""


class QueueTimeoutError(EngineError):
    """A request waited in the pending queue longer than `pending_timeout_ms`."""


class RequestNotFoundError(EngineError, KeyError):
    """No request (or parked prefill handle) with that id, or its lease expired."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "request not found"


class EngineDeadError(EngineError):
    """The engine loop stopped (shutdown or a crash); no request can be served."""
