"""Waiting in tests for what another thread or process does."""

from __future__ import annotations

import time


def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    """Poll `predicate` every 50 ms until it holds or `timeout_s` passes; its last answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()
