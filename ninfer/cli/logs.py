"""structlog configuration for the command line: JSON or console lines, always on stderr."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


def configure_logging(json_logs: bool = False, level: str = "info", stream: TextIO | None = None) -> None:
    """Request-scoped fields (request_id) bound with structlog.contextvars appear on every line."""
    renderer = structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )
