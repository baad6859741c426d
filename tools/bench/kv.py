"""int8 KV against the model-dtype KV: decode batch 1, k=0, at long contexts (where KV bytes matter).

Both engines are held together and take turns at each context (model dtype, int8, model dtype, ...;
`pairs`, tools/bench/interleave.py); `int8_over_bf16_kv_decode_32k` is the median of the per-rep
ratios at the reference context (derive.py). The bytes say how much int8 can win at most:
(weights + C x KV_bf16) / (weights + C x KV_int8).
"""

from __future__ import annotations

from tools.bench import interleave, shapes
from tools.bench.decode import decode_rep, point_from_reps, seconds_per_token, tokens_for
from tools.bench.progress import say


def run(bench, sec: dict) -> None:
    plan = bench.plan.kv
    points = sec.setdefault("points", [])
    pairs = sec.setdefault("pairs", [])
    base_kv = "bfloat16" if bench.kind == "cuda" else "float32"
    # the model-dtype side is the shared k = 0 engine (the decode section's, when it is still held)
    specs = {base_kv: bench.engine_spec(draft_tokens=0), "int8": bench.engine_spec(draft_tokens=0, kv_dtype="int8")}
    builds = sum(not bench.pool.holds(s) for s in specs.values())
    first = builds * bench.build_guess_s() + bench.estimate_prefill_s(min(plan.contexts))
    if not bench.budget.allows(first):
        sec["int8_over_bf16_reason"] = bench.budget.skip_reason(first)
        sec["status"] = "skipped"
        sec["reason"] = sec["int8_over_bf16_reason"]
        return
    base, _ = bench.pool.get(specs[base_kv], warm_prompt=min(plan.contexts), warm_decode=32, keep=(specs["int8"],))
    int8, _ = bench.pool.get(specs["int8"], warm_prompt=min(plan.contexts), warm_decode=32, keep=(specs[base_kv],))
    s_tok = seconds_per_token(base, min(plan.contexts))
    for c in plan.contexts:
        max_tokens = tokens_for(bench.plan.decode, s_tok)
        one = bench.estimate_prefill_s(c) + max_tokens * s_tok
        if not bench.budget.allows(2 * one):
            points.append({"context": c, "draft_tokens": 0, "skipped": bench.budget.skip_reason(2 * one)})
            continue
        pair = interleave.run({base_kv: lambda: decode_rep(bench, base, c, max_tokens),
                               "int8": lambda: decode_rep(bench, int8, c, max_tokens)},
                              plan.repeats, bench.budget, 2 * one, context=c, max_tokens=max_tokens,
                              base_kv_dtype=base_kv, tensor_parallel_size=1)
        pairs.append(pair)
        for kv_dtype, session in ((base_kv, base), ("int8", int8)):
            points.append({**point_from_reps(pair["reps"][kv_dtype], c, max_tokens, session.describe, "kv"),
                           "kv_dtype": kv_dtype})
        r = interleave.reduce_pair(pair, "int8", base_kv, "decode_tok_s")
        bytes_ratio = (shapes.decode_bytes_per_step(bench.cfg, c, base_kv, base_kv)
                       / shapes.decode_bytes_per_step(bench.cfg, c, base_kv, "int8"))
        sec.setdefault("ratios", []).append({"context": c, "base_kv_dtype": base_kv, "ratio": r["value"],
                                             "per_rep": r["per_rep"], "bytes_ratio": bytes_ratio})
        say("kv", f"ctx={c}: int8 / {base_kv} = {r['value'] or 0:.3f} ({r['rule']}, {r['reps']} reps; "
                  f"bytes allow {bytes_ratio:.3f})")
        bench.save()
    sec["status"] = "ok"
