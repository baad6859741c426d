"""Derived figures: MFU, roofline fractions, ratios, the acceptance-implied decode rates, and the
headline with its targets. Pure arithmetic on the raw figures in `results`, re-run before every
write, so a report rebuilt from merged runs derives everything the same way.

The headline (tools/bench/headline.py) follows one rule (tools/bench/interleave.py): a ratio is the
median of the per-rep ratios of interleaved reps, a difference the median of the per-rep
differences, a single figure the median over its reps; never the best rep; fewer than three reps
give null. A headline figure that cannot be computed is null, with the reason in `headline_detail`.
"""

from __future__ import annotations

import statistics

from tools.bench import headline, interleave, shapes
from tools.bench.raw import measured as _measured, rep_ms_per_round, roofline_of  # noqa: F401 - re-exported
from tools.bench.targets import TARGETS  # noqa: F401 - re-exported: the report and the tests read it here

HEADLINE_BASIS = ("every headline key: the median over at least 3 interleaved reps (A, B, A, B, ... in this run); "
                  "a ratio is the median of the per-rep ratios, a difference the median of the per-rep differences; "
                  "never the best rep. Tables beside them show peaks and medians of the sweeps")


def _cfg(results: dict, shape: str | None = None):
    return shapes.model_config(shape or results["run"]["shape"])


def _dtype(engine: dict | None) -> tuple[str, str]:
    engine = engine or {}
    return engine.get("dtype", "bfloat16"), engine.get("kv_dtype", engine.get("dtype", "bfloat16"))


def decode_floor(results: dict, point: dict, shape: str | None = None, run_id: str | None = None) -> float | None:
    bw, _ = roofline_of(results, run_id)
    if bw is None or point.get("ms_per_round_median") is None:
        return None
    dtype, kv = _dtype(point.get("engine"))
    tp = (point.get("engine") or {}).get("tensor_parallel_size", 1)
    context = point["context"] + point["max_tokens"] / 2          # mean context over the request
    return shapes.decode_floor_ms(_cfg(results, shape), context, bw, dtype, kv, tp)


def annotate(results: dict) -> None:
    secs = results.setdefault("sections", {})
    cfg = _cfg(results)
    ref = results.get("plan", {}).get("reference", {})

    _, mm = roofline_of(results, secs.get("peer", {}).get("run_id"))
    if mm is not None:
        for p in _measured(secs.get("peer", {}).get("prefill", [])):
            p["mfu_peak"] = shapes.mfu(cfg, p["P"], p["tok_s_peak"], mm)
            p["mfu_median"] = shapes.mfu(cfg, p["P"], p["tok_s_median"], mm)
    _, mm = roofline_of(results, secs.get("prefill", {}).get("run_id"))
    prefill = _measured(secs.get("prefill", {}).get("points", []))
    for p in prefill:
        if mm is not None:
            p["mfu_peak"] = shapes.mfu(cfg, p["P"], p["prefill_tok_s_peak"], mm)
            p["mfu_median"] = shapes.mfu(cfg, p["P"], p["prefill_tok_s_median"], mm)
            p["mfu_per_rep"] = [shapes.mfu(cfg, p["P"], r["prefill_tok_s"], mm) for r in p["repeats"]]
        base = [q for q in prefill if q["chunk"] == p["chunk"] and q["P"] == ref.get("prefill_P")]
        p["relative_to_ref_P"] = p["prefill_tok_s_median"] / base[0]["prefill_tok_s_median"] if base else None

    for name in ("decode", "kv", "tp", "hybrid", "moe"):
        for p in _measured(secs.get(name, {}).get("points", [])):
            if p.get("draft_tokens", 0) == 0 and p.get("ms_per_round_median"):
                floor = decode_floor(results, p, p.get("shape"), secs[name].get("run_id"))
                p["floor_ms"] = floor
                per_rep = [floor / m for m in map(rep_ms_per_round, p.get("repeats", [])) if m] if floor else []
                p["roofline_fraction_per_rep"] = per_rep
                p["roofline_fraction"] = statistics.median(per_rep) if per_rep else None

    conc = secs.get("concurrency", {})
    single = [p for p in _measured(conc.get("points", [])) if p["streams"] == 1]
    for p in _measured(conc.get("points", [])):
        if single and p.get("reps"):
            r = interleave.reduce_values([a["aggregate_tok_s"] / b["aggregate_tok_s"]
                                          for a, b in zip(p["reps"], single[0]["reps"])], minimum=1)
            p["aggregate_over_single"] = r["value"]
        else:
            p["aggregate_over_single"] = None

    acc = secs.get("acceptance", {})
    ms = _ms_per_round_table(results, acc.get("implied_context") or ref.get("decode_context"))
    for e in acc.get("results", []):
        if "skipped" in e:
            continue
        m = ms.get(e["k"])
        e["implied_decode_tok_s"] = e["tokens_per_round"] / m * 1e3 if m else None
        e["implied_from_ms_per_round"] = m
    if acc.get("results") is not None:
        acc["k0_decode_tok_s"] = 1e3 / ms[0] if ms.get(0) else None

    _pd(secs.get("pd", {}))
    results["headline"], results["headline_detail"] = headline.compute(results)
    results["headline_basis"] = HEADLINE_BASIS


def _pd(sec: dict) -> None:
    """PD over a single engine through smg, per stream count: TTFT and inter-token time, each the median of
    the per-round ratios PD / single (above 1: PD is slower)."""
    for record in (sec.get("streams") or {}).values():
        for metric in ("ttft_ms_median", "inter_token_ms_median"):
            r = interleave.reduce_pair(record, "pd", "single", metric)
            record[metric.replace("_ms_median", "_pd_over_single")] = r["value"]


def _ms_per_round_table(results: dict, context: int | None, draft_vocab: int = 0) -> dict[int, float]:
    """k -> median ms_per_round at `context` from the decode sweep, drafting over `draft_vocab` ids
    (0 = the full vocabulary); k = 0 has no draft and is shared by both tables."""
    out = {}
    for p in _measured(results.get("sections", {}).get("decode", {}).get("points", [])):
        same_vocab = (p.get("draft_vocab") or 0) == draft_vocab or p["draft_tokens"] == 0
        if p["context"] == context and same_vocab and p.get("ms_per_round_median"):
            if p["draft_tokens"] == 0 and p.get("draft_vocab"):
                continue
            out[p["draft_tokens"]] = p["ms_per_round_median"]
    return out


def extra_draft_cost(ms: dict[int, float]) -> float | None:
    """Mean over k >= 1 of (ms_per_round(k) - ms_per_round(0)) / (k x ms_per_round(0))."""
    if 0 not in ms:
        return None
    fractions = [(m - ms[0]) / (k * ms[0]) for k, m in ms.items() if k >= 1]
    return sum(fractions) / len(fractions) if fractions else None
