"""Mixtures of experts (issue 42): `preset:qwen3-30b-a3b` with random weights, decode batch 1 at TP=1 and
TP=2 (where two GPUs are lent).

A decode point's floor is the bytes one rank moves per step over the copy bandwidth measured in the same
run -- the weights it reads (the experts the token chose, not all 128 of a layer: tools/bench/shapes.py),
the KV at the point's mean context -- and `derive` turns it into the point's roofline fraction
(`moe_30b_a3b_decode_b1_roofline_fraction`, the TP=1 point) and the TP=2 over TP=1 speed-up
(`moe_30b_a3b_tp2_over_tp1_decode_b1`). Random routers spread tokens over the experts about uniformly; a
trained model's routing is what a served figure would see (its experts per step at batch > 1 differ).
On the CPU it is a dry run of the same code at the `tiny-moe` shape.
"""

from __future__ import annotations

from tools.bench import shapes
from tools.bench.decode import decode_point
from tools.bench.progress import say


def run(bench, sec: dict) -> None:
    plan = bench.plan.moe
    cfg = shapes.model_config(plan.shape)
    tps = [tp for tp in plan.tensor_parallel_sizes if bench.kind == "cpu" or tp <= bench.gpu_count()]
    if bench.kind == "cpu":
        sec["note"] = f"CPU dry run at the {plan.shape} shape: not GPU figures"
    elif len(tps) < len(plan.tensor_parallel_sizes):
        sec["note"] = f"{bench.gpu_count()} GPU(s): TP={max(plan.tensor_parallel_sizes)} not measured"
    sec.update(shape=plan.shape, context=plan.context, describe=shapes.describe(cfg, "bfloat16"),
               weight_bytes_per_step={str(tp): shapes.weight_bytes_per_step(cfg, "bfloat16", tp) for tp in tps})
    points = sec.setdefault("points", [])
    for tp in tps:
        guess = bench.build_guess_s() * 2
        if not bench.budget.allows(guess):
            points.append({"tensor_parallel_size": tp, "skipped": bench.budget.skip_reason(guess)})
            continue
        cap = plan.context + plan.decode_tokens + 64
        spec = bench.engine_spec(model=f"preset:{plan.shape}", draft_tokens=0, tensor_parallel_size=tp,
                                 kv_capacity=cap, max_model_len=cap, max_batch=4, extra=(("prefix_reuse", False),))
        session, _ = bench.pool.get(spec, warm_prompt=plan.context, warm_decode=16)
        say("moe", f"engine {plan.shape} TP={tp}: {session.setup_text}")
        p = decode_point(bench, session, plan.context, plan.repeats, plan.decode_tokens, "moe")
        points.append({**p, "label": "decode", "shape": plan.shape, "tensor_parallel_size": tp})
        bench.save()
        bench.pool.close()
    measured = [p for p in points if "skipped" not in p]
    sec["status"] = "ok" if measured else "skipped"
    if not measured:
        sec.setdefault("reason", "no point measured")
