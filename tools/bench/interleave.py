"""Interleaved reps: how every headline comparison is measured, recorded and reduced.

A comparison runs its sides in turn -- A, B, A, B, ... -- for at least `MIN_REPS` rounds within one
run, so that whatever drifts on the machine (clocks, temperature, a neighbour) falls on both sides
alike. Its record in results.json keeps the order the calls ran in and each side's figures per rep:

    {"sides": ["engine", "compiled_peer"],
     "order": ["engine", "compiled_peer", "engine", "compiled_peer", "engine", "compiled_peer"],
     "reps": {"engine": [{"ms_per_token": 4.14, ...}, ...], "compiled_peer": [{"ms_per_token": 4.55, ...}, ...]},
     "tensor_parallel_size": 1, ...}

The rule, one for every headline key (tools/bench/derive.py): a ratio is the **median of the
per-rep ratios** -- rep i of A over rep i of B, measured back to back -- and a difference the median
of the per-rep differences; a single figure (a roofline fraction, an MFU) is the median over its
reps. Never the best rep. Fewer than `MIN_REPS` paired reps give no headline figure: null, with the
reason. Pure Python: derive and the tests use it without torch.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

MIN_REPS = 3
RULE_RATIO = "median of the per-rep ratios of interleaved reps"
RULE_DIFFERENCE = "median of the per-rep differences of interleaved reps"
RULE_MEDIAN = "median over the reps"


def run(sides: dict[str, Callable[[], dict]], reps: int, budget=None, round_s: float = 0.0,
        **fields: Any) -> dict:
    """Call every side once per round, in the order given, for `reps` rounds. Each call returns its
    rep's figures (a dict). A `budget` (tools.bench.progress.Budget) that cannot fit another round of
    `round_s` seconds ends the comparison after the rounds already complete (`stopped` says why).
    `fields` are kept in the record (the shape, the TP size, the context...)."""
    record: dict[str, Any] = {"sides": list(sides), "order": [], "reps": {name: [] for name in sides}, **fields}
    for i in range(reps):
        if i > 0 and budget is not None and not budget.allows(round_s):
            record["stopped"] = f"after {i} of {reps} rounds: {budget.skip_reason(round_s)}"
            break
        for name, call in sides.items():
            record["reps"][name].append(call())
            record["order"].append(name)
    return record


def values(record: dict, side: str, metric) -> list[float | None]:
    """Side `side`'s figure per rep: `metric` is a key of the rep's record, or a function of the record."""
    return [metric(r) if callable(metric) else r.get(metric) for r in (record.get("reps") or {}).get(side, [])]


def reduce_pair(record: dict | None, a: str, b: str, metric, op: str = "ratio", metric_b=None,
                minimum: int = MIN_REPS) -> dict:
    """Side `a` over (or minus) side `b`, rep by rep, then the median. -> {"value", "per_rep", "reps",
    "rule", "reason"}; value None (and the reason) when the record has fewer than MIN_REPS complete pairs."""
    rule = RULE_RATIO if op == "ratio" else RULE_DIFFERENCE
    if not record:
        return {"value": None, "per_rep": [], "reps": 0, "rule": rule, "reason": "not measured"}
    xs, ys = values(record, a, metric), values(record, b, metric_b or metric)
    pairs = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None and (op != "ratio" or y > 0)]
    per_rep = [x / y if op == "ratio" else x - y for x, y in pairs]
    reason = None if len(per_rep) >= minimum else (f"{len(per_rep)} paired reps of {a} and {b} (a headline "
                                                   f"figure needs {minimum})")
    return {"value": statistics.median(per_rep) if reason is None else None, "per_rep": per_rep,
            "reps": len(per_rep), "rule": rule, "reason": reason}


def reduce_values(per_rep: list[float | None], what: str = "reps", rule: str = RULE_MEDIAN,
                  minimum: int = MIN_REPS) -> dict:
    """The median of one figure's reps (a roofline fraction, an MFU), or of per-rep ratios computed by
    the caller (then `rule` says so)."""
    xs = [x for x in per_rep if x is not None]
    reason = None if len(xs) >= minimum else f"{len(xs)} {what} (a headline figure needs {minimum})"
    return {"value": statistics.median(xs) if reason is None else None, "per_rep": xs, "reps": len(xs),
            "rule": rule, "reason": reason}


def interleaved(record: dict) -> bool:
    """Whether the record's order really alternates its sides round by round (what the tests check)."""
    sides, order = record.get("sides") or [], record.get("order") or []
    if not sides or len(order) % len(sides):
        return False
    return all(order[i:i + len(sides)] == sides for i in range(0, len(order), len(sides)))
