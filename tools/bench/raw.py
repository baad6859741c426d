"""Reading results.json's raw figures: the limits a run measured, the points that were measured, and
one request's ms per round. Shared by derive.py and headline.py."""

from __future__ import annotations


def roofline_of(results: dict, run_id: str | None = None) -> tuple[float | None, float | None]:
    """(copy bandwidth B/s, matmul FLOP/s): those of the run `run_id` when it measured them (a merged
    report derives each section against its own run's limits), else the roofline section's."""
    own = results.get("runs", {}).get(run_id, {}).get("roofline") if run_id else None
    if own:
        return own.get("bandwidth_Bps"), own.get("flops_per_s")
    sec = results.get("sections", {}).get("roofline", {})
    bw = (sec.get("copy") or {}).get("bandwidth_Bps")
    mm = (sec.get("matmul") or {}).get("flops_per_s")
    return bw, mm


def measured(points: list[dict] | None) -> list[dict]:
    return [p for p in points or [] if "skipped" not in p and "error" not in p]


def rep_ms_per_round(rep: dict) -> float | None:
    """One request's ms per round: decode time over rounds (k = 0: one round per token after the first)."""
    rounds = rep.get("rounds") if rep.get("draft_tokens", 0) > 0 else rep.get("completion_tokens", 0) - 1
    return rep["decode_s"] / rounds * 1e3 if rounds and rounds > 0 and rep.get("decode_s", 0) > 0 else None
