"""int8 KV against the model-dtype KV: decode batch 1, k=0, at long contexts (where KV bytes matter).

The model-dtype side is the decode sweep's k=0 figure at the same context when that section ran in
this run (same engine settings but the KV dtype); otherwise it is measured here. The bytes say how
much int8 can win at most: (weights + C x KV_bf16) / (weights + C x KV_int8).
"""

from __future__ import annotations

from tools.bench import shapes
from tools.bench.decode import decode_point, seconds_per_token, tokens_for
from tools.bench.progress import say


def _from_decode(bench, context: int) -> dict | None:
    dec = bench.results["sections"].get("decode", {})
    if dec.get("run_id") != bench.results["run"]["run_id"]:
        return None
    for p in dec.get("points", []):
        if p.get("draft_tokens") == 0 and not p.get("draft_vocab") and p.get("context") == context and "repeats" in p:
            return p
    return None


def run(bench, sec: dict) -> None:
    plan = bench.plan.kv
    dplan = bench.plan.decode
    points = sec.setdefault("points", [])
    ref_ctx = bench.plan.reference["kv_context"]
    base_kv = "bfloat16" if bench.kind == "cuda" else "float32"
    spec_of = {base_kv: bench.engine_spec(draft_tokens=0), "int8": bench.engine_spec(draft_tokens=0, kv_dtype="int8")}
    # measure on the engine the pool holds first; end on the model-dtype engine, which later sections reuse
    order = (base_kv, "int8") if bench.pool.holds(spec_of[base_kv]) else ("int8", base_kv)
    for kv_dtype in order:
        todo = []
        for c in plan.contexts:
            p = _from_decode(bench, c) if kv_dtype == base_kv else None
            if p is not None:
                points.append({**p, "kv_dtype": kv_dtype, "source": "decode section, this run"})
            else:
                todo.append(c)
        if not todo:
            continue
        spec = spec_of[kv_dtype]
        first = (0 if bench.pool.holds(spec) else bench.build_guess_s()) + bench.estimate_prefill_s(min(todo))
        if not bench.budget.allows(first):
            for c in todo:
                points.append({"context": c, "kv_dtype": kv_dtype, "draft_tokens": 0,
                               "skipped": bench.budget.skip_reason(first)})
            continue
        session, _ = bench.pool.get(spec, warm_prompt=min(todo), warm_decode=32)
        s_tok = seconds_per_token(session, min(todo))
        for c in todo:
            max_tokens = tokens_for(dplan, s_tok)
            one = bench.estimate_prefill_s(c) + max_tokens * s_tok
            if not bench.budget.allows(one):
                points.append({"context": c, "kv_dtype": kv_dtype, "draft_tokens": 0,
                               "skipped": bench.budget.skip_reason(one)})
                continue
            repeats = plan.repeats if bench.budget.allows(one * plan.repeats) else 1
            point = decode_point(bench, session, c, repeats, max_tokens, "kv")
            points.append({**point, "kv_dtype": kv_dtype, "source": "measured here"})
            bench.save()

    by = {(p["kv_dtype"], p["context"]): p for p in points if "repeats" in p}
    cfg = bench.cfg
    sec["ratios"] = []
    for c in plan.contexts:
        a, b = by.get(("int8", c)), by.get((base_kv, c))
        if a and b:
            bytes_ratio = (shapes.decode_bytes_per_step(cfg, c, base_kv, base_kv)
                           / shapes.decode_bytes_per_step(cfg, c, base_kv, "int8"))
            r = {"context": c, "int8_tok_s": a["decode_tok_s_peak"], "base_tok_s": b["decode_tok_s_peak"],
                 "base_kv_dtype": base_kv, "ratio": a["decode_tok_s_peak"] / b["decode_tok_s_peak"],
                 "bytes_ratio": bytes_ratio}
            sec["ratios"].append(r)
            say("kv", f"ctx={c}: int8 / {base_kv} = {r['ratio']:.3f} (bytes allow {bytes_ratio:.3f})")
            if c == ref_ctx:
                sec["int8_over_bf16"] = r["ratio"]
                sec["int8_over_bf16_inputs"] = r
    if "int8_over_bf16" not in sec:
        sec["int8_over_bf16_reason"] = f"no int8 and {base_kv} pair at context {ref_ctx}"
    sec["status"] = "ok"
