"""Progress on stderr (each figure as it lands) and time budgets that keep every section bounded."""

from __future__ import annotations

import sys
import time

_T0 = time.monotonic()


def say(section: str, message: str) -> None:
    print(f"[{time.monotonic() - _T0:7.1f}s] {section:<11} {message}", file=sys.stderr, flush=True)


class OutOfBudget(Exception):
    """Raised to leave a section early; what was measured so far is kept."""


class Budget:
    """A soft deadline: before each measurement the section asks whether its predicted time fits.

    A point that is predicted not to fit is skipped and recorded with the reason; nothing is cut
    half-way (a request that is running is waited for, up to its own timeout).
    """

    def __init__(self, seconds: float, hard_deadline: float | None = None, clock=time.monotonic):
        self.clock = clock
        self.start = clock()
        end = self.start + seconds
        self.deadline = end if hard_deadline is None else min(end, hard_deadline)

    def left(self) -> float:
        return self.deadline - self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def allows(self, predicted_s: float) -> bool:
        return predicted_s <= self.left()

    def skip_reason(self, predicted_s: float) -> str:
        return f"time budget: predicted {predicted_s:.1f} s, {max(0.0, self.left()):.1f} s left in the section"


def fmt_rate(x: float | None, unit: str = "tok/s") -> str:
    if x is None:
        return "-"
    return f"{x:,.0f} {unit}" if x >= 100 else f"{x:.2f} {unit}"


def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def si(x: float | None, unit: str) -> str:
    """1.23e12, "B/s" -> "1.23 TB/s"."""
    if x is None:
        return "-"
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"
