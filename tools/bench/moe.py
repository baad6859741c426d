"""Mixture of experts at the Qwen3-30B-A3B shape (random weights): decode batch 1 against the floor of
the bytes one step really reads, and TP2 against TP1.

At batch 1 a step reads the attention weights, each MoE layer's router and the `num_experts_per_tok`
experts the token is routed to (not all `num_experts`), the shared expert where the model has one,
the lm_head, and the KV at the context (tools/bench/shapes.py: `weight_bytes_per_step` counts the
active parameters of a mixture of experts). derive.py turns the point's reps into
`moe_30b_a3b_decode_b1_roofline_fraction` (the median over the reps of floor / ms per token). With two
GPUs (or on the CPU, two in-process ranks) the TP1 and TP2 engines take turns on decode batch 1
(`pairs["decode_b1"]`): `moe_30b_a3b_tp2_over_tp1_decode_b1`, the median of the per-rep ratios.

The shape is a preset of the engine (`plan.moe.shape`); a checkout without it, or whose config is not
a mixture of experts, records the section as skipped with the reason.
"""

from __future__ import annotations

from engine.errors import InvalidArgumentError, ModelLoadError
from tools.bench import interleave, shapes
from tools.bench.decode import decode_rep, point_from_reps, seconds_per_token, tokens_for
from tools.bench.progress import say


def _skip(sec: dict, reason: str) -> None:
    sec.update(status="skipped", reason=reason)
    say("moe", f"skipped: {reason}")


def run(bench, sec: dict) -> None:
    plan = bench.plan.moe
    try:
        cfg = shapes.model_config(plan.shape)
    except ModelLoadError as e:
        return _skip(sec, f"no preset:{plan.shape} in this checkout ({e})"[:400])
    if not getattr(cfg, "is_moe", False):
        return _skip(sec, f"preset:{plan.shape} is not a mixture of experts")
    sec.update(shape=plan.shape, describe=shapes.describe(cfg, "bfloat16"),
               active_weight_bytes_per_step=shapes.weight_bytes_per_step(cfg))
    if not bench.budget.allows(bench.build_guess_s() * 2):
        return _skip(sec, bench.budget.skip_reason(bench.build_guess_s() * 2))

    def spec(tp: int):
        return bench.engine_spec(model=f"preset:{plan.shape}", draft_tokens=0, tensor_parallel_size=tp,
                                 kv_capacity=plan.kv_capacity, max_model_len=plan.kv_capacity, prefill_chunk=plan.chunk,
                                 max_batch=4)

    two = bench.kind == "cpu" or bench.gpu_count() >= 2
    tp1, _ = bench.pool.get(spec(1), warm_prompt=plan.context, warm_decode=16, keep=(spec(2),) if two else ())
    say("moe", f"engine {plan.shape} TP=1: {tp1.setup_text}")
    tokens = tokens_for(bench.plan.decode, seconds_per_token(tp1, plan.context))
    points = sec.setdefault("points", [])
    if not two:
        reps = [decode_rep(bench, tp1, plan.context, tokens) for _ in range(plan.reps)]
        points.append({**point_from_reps(reps, plan.context, tokens, tp1.describe, "moe"), "label": "tp1",
                       "shape": plan.shape})
        sec["tp2_reason"] = f"needs 2 GPUs, found {bench.gpu_count()}"
    else:
        try:
            tp2, _ = bench.pool.get(spec(2), warm_prompt=plan.context, warm_decode=16, keep=(spec(1),))
        except (InvalidArgumentError, NotImplementedError) as e:
            sec["tp2_reason"] = f"the engine refused tensor_parallel_size=2: {e}"[:400]
            tp2 = None
        sides = {"tp1": tp1} if tp2 is None else {"tp1": tp1, "tp2": tp2}
        pair = interleave.run({label: (lambda s=s: decode_rep(bench, s, plan.context, tokens)) for label, s in sides.items()},
                              plan.reps, context=plan.context, max_tokens=tokens, shape=plan.shape,
                              tensor_parallel_size={label: int(label[2]) for label in sides})
        sec.setdefault("pairs", {})["decode_b1"] = pair
        for label, s in sides.items():
            points.append({**point_from_reps(pair["reps"][label], plan.context, tokens, s.describe, "moe"),
                           "label": label, "shape": plan.shape})
    bench.save()
    bench.pool.close()
    sec["status"] = "ok"
