"""Waiting in tests for what another thread or process does."""

from __future__ import annotations

import time


def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
    """Poll `predicate` every `interval_s` until it holds or `timeout_s` passes; its last answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def wait_until(predicate, timeout_s: float = 30.0, what: str = "condition") -> None:
    """Poll `predicate` every 10 ms; fail the test, naming `what`, if it does not hold within `timeout_s`."""
    assert wait_for(predicate, timeout_s, interval_s=0.01), f"{what}: not reached within {timeout_s} s"
