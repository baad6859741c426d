"""Qwen3.5-class hybrids (issue 16): `preset:qwen3.5-27b` with random weights, served the way the
seed serves it -- TP=2, int8 KV for the 16 full-attention layers -- on one engine:

  decode    batch 1, k = 0, at a short, an 8k and a 128k context. The 48 Gated DeltaNet layers read
            and write the same float32 state at every context; only the full-attention layers' KV
            grows, so ms per token should rise by that KV's bytes alone.
  prefill   one fresh prompt of 4k, then of 32k tokens, at the plan's chunk (the state carried
            across chunks).
  long      one 192k-token context: the prompt, then 512 decoded tokens.
  one GPU   the seed's other deployment: the same shape quantized (NVFP4 by default), int8 KV, one
            GPU -- decode at the short context against its own floor, and the 192k context.

A decode point's floor is the bytes one rank moves per step -- its weight shard (embedding gather
excluded, lm_head included), the int8 KV of the full-attention layers at the point's mean context,
and the linear-attention state read and written once -- over the copy bandwidth measured in the same
run (tools/bench/shapes.py); `derive` turns it into the point's roofline fraction (the median over
the reps at the first context). With one GPU the section runs at TP=1 (the 27B fits an H200 in bf16)
and says so; the headline keys `hybrid_27b_tp2_decode_roofline_fraction` and `hybrid_192k_ok` are
TP=2's only (null at TP=1, with the reason; the TP=1 figures stay in the section).
On the CPU it is a dry run of the same code at the `tiny-hybrid` shape.
"""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from tools.bench import shapes
from tools.bench.decode import decode_point
from tools.bench.progress import fmt_rate, say
from tools.bench.session import compact, random_prompt


WARM_PROMPT = 512        # the warm-up prompt, and the one-GPU decode point, where a plan asks no decode context


def _capacity(plan) -> int:
    """KV tokens an engine of `plan` (this section's or the quant section's) needs: its longest request."""
    asks = [plan.long_context, *getattr(plan, "prefill_prompts", ()), WARM_PROMPT + plan.decode_tokens,
            *(c + plan.decode_tokens for c in plan.decode_contexts)]
    return max(asks) + 64


def _first_context(plan) -> int:
    return (plan.decode_contexts or [WARM_PROMPT])[0]


def _engine(bench, plan, tp: int):
    cap = _capacity(plan)
    spec = bench.engine_spec(model=f"preset:{plan.shape}", draft_tokens=0, tensor_parallel_size=tp,
                             kv_dtype=plan.kv_dtype, kv_capacity=cap, max_model_len=cap, prefill_chunk=plan.chunk,
                             max_batch=4, extra=(("prefix_reuse", False),))
    return bench.pool.get(spec, warm_prompt=_first_context(plan), warm_decode=16)


def run(bench, sec: dict) -> None:
    plan = bench.plan.hybrid
    cfg = shapes.model_config(plan.shape)
    tp = plan.tensor_parallel_size
    if bench.kind == "cuda" and bench.gpu_count() < tp:
        sec["note"] = f"{bench.gpu_count()} GPU(s): run at TP=1; the TP=2 headline is not measured"
        tp = 1
    if bench.kind == "cpu":
        sec["note"] = "CPU dry run at the tiny-hybrid shape: not GPU figures"
    sec.update(shape=plan.shape, tensor_parallel_size=tp, kv_dtype=plan.kv_dtype, deployments=list(plan.deployments),
               describe=shapes.describe(cfg, "bfloat16"))
    if "tp" in plan.deployments:
        _tp_deployment(bench, sec, plan, cfg, tp)
    if "one_gpu" in plan.deployments and plan.one_gpu_format:
        one_gpu_deployment(bench, sec.setdefault("one_gpu", {}), plan, cfg, "hybrid_one_gpu_192k_ok")
    measured = (sec.get("points") or sec.get("prefill") or sec.get("long_context")
                or (sec.get("one_gpu") or {}).get("point"))
    sec["status"] = "ok" if measured else "skipped"
    if not measured:
        sec.setdefault("reason", (sec.get("one_gpu") or {}).get("reason") or "no deployment measured")


def _tp_deployment(bench, sec: dict, plan, cfg, tp: int) -> None:
    guess = bench.build_guess_s() * 3                   # 27B of random weights, graphs of 64 layers
    if not bench.budget.allows(guess):
        sec["reason"] = bench.budget.skip_reason(guess)
        return
    session, _ = _engine(bench, plan, tp)
    say("hybrid", f"engine {plan.shape} TP={tp} {plan.kv_dtype} KV: {session.setup_text}")
    sec["engine"] = session.describe
    sec["state_bytes_per_request_per_rank"] = shapes.state_bytes_per_step(cfg, tp) // 2

    points = sec.setdefault("points", [])
    for ctx in plan.decode_contexts:
        est = bench.estimate_prefill_s(ctx, cfg=cfg) / tp + plan.decode_tokens * 0.05
        if not bench.budget.allows(est):
            points.append({"context": ctx, "skipped": bench.budget.skip_reason(est)})
            continue
        reps = plan.decode_reps if ctx == plan.decode_contexts[0] else 1      # the headline's context: a median
        p = decode_point(bench, session, ctx, reps, plan.decode_tokens, "hybrid")
        points.append({**p, "label": "decode", "shape": plan.shape})
        bench.save()

    rows = sec.setdefault("prefill", [])
    for P in plan.prefill_prompts:
        est = bench.estimate_prefill_s(P, cfg=cfg) / tp
        if not bench.budget.allows(est):
            rows.append({"P": P, "skipped": bench.budget.skip_reason(est)})
            continue
        r = compact(session.generate(random_prompt(P, session.vocab), SamplingParams(max_tokens=1, temperature=0.0),
                                     timeout=max(120.0, 5 * est)))
        _, mm = bench.roofline()
        rows.append({"P": P, "chunk": plan.chunk, "prefill_tok_s": r["prefill_tok_s"],
                     "computed_prefill_tokens": r["computed_prefill_tokens"],
                     "mfu_per_gpu": shapes.mfu(cfg, P, r["prefill_tok_s"], mm) / tp if mm else None})
        bench.note_prefill_rate("hybrid", P, r["prefill_tok_s"], cfg=cfg)
        say("hybrid", f"prefill P={P}: {fmt_rate(r['prefill_tok_s'])}")
        bench.save()

    _long_context(bench, session, plan, cfg, tp, sec, "hybrid_192k_ok")
    bench.save()
    bench.pool.close()


def _long_context(bench, session, plan, cfg, tp: int, sec: dict, key: str, who: str = "hybrid") -> None:
    """One long context on `session`: sec["long_context"] (the request's figures), sec[key] (whether
    it ran whole) and sec[key + "_inputs"], or sec[key + "_reason"] when the budget skips it."""
    n_dec = plan.long_decode_tokens
    P = plan.long_context - n_dec
    if plan.long_context <= 0:
        sec[key + "_reason"] = "not asked (long context 0)"
        return
    if P <= 0:
        sec[key + "_reason"] = (f"the long context ({plan.long_context} tokens) is no longer than its {n_dec} "
                                "decoded tokens")
        return
    est = bench.estimate_prefill_s(P, who=who, cfg=cfg) / tp + n_dec * 0.05
    if not bench.budget.allows(est):
        sec[key + "_reason"] = bench.budget.skip_reason(est)
        say(who, f"long context skipped ({sec[key + '_reason']})")
        return
    try:
        r = compact(session.generate(random_prompt(P, session.vocab), SamplingParams(max_tokens=n_dec, ignore_eos=True, temperature=0.0),
                                     timeout=max(600.0, 3 * est)))
    except Exception as e:  # noqa: BLE001 - the figure is whether it works
        sec["long_context"], sec[key], sec[key + "_inputs"] = {"prompt_tokens": P, "error": repr(e)[:400]}, False, {}
        return
    ok = r["computed_prefill_tokens"] == P and r["completion_tokens"] == n_dec and r["finish_reason"] == "length"
    sec["long_context"], sec[key] = {**r, "context": P + n_dec}, ok
    sec[key + "_inputs"] = {"shape": session.spec.model, "tensor_parallel_size": tp, "kv_dtype": plan.kv_dtype,
                            "prompt_tokens": P, "decoded": r["completion_tokens"], "prefill_tok_s": r["prefill_tok_s"],
                            "decode_tok_s": r["decode_tok_s"]}
    say(who, f"{P + n_dec}-token context, {session.spec.model} TP={tp} {plan.kv_dtype}: {'ok' if ok else 'FAILED'} "
                  f"(prefill {fmt_rate(r['prefill_tok_s'])}, decode {fmt_rate(r['decode_tok_s'])})")


def one_gpu_deployment(bench, sec: dict, plan, cfg, key: str, who: str = "hybrid") -> None:
    """The seed's one-GPU deployment: the shape's quantized checkpoint (random weights, quantized on
    the device), int8 KV, TP=1 -- decode at the shortest context against its own floor (packed
    weights and scales, bf16 lm_head, KV, state) and the long context; sec[key] says whether it ran.
    The quant section calls it for the dense qwen3-32b (issue 14), this one for the hybrid."""
    from engine.worker.memory_plan import shard_bytes
    from engine.loading.presets import preset
    model = f"preset:{plan.shape}-{plan.one_gpu_format}"
    guess = bench.build_guess_s() * 3
    if not bench.budget.allows(guess):
        sec["reason"] = bench.budget.skip_reason(guess)
        return
    cap = _capacity(plan)
    spec = bench.engine_spec(model=model, draft_tokens=0, tensor_parallel_size=1, kv_dtype=plan.kv_dtype,
                             kv_capacity=cap, max_model_len=cap, prefill_chunk=plan.chunk, max_batch=4,
                             extra=(("prefix_reuse", False),))
    ctx = _first_context(plan)
    session, _ = bench.pool.get(spec, warm_prompt=ctx, warm_decode=16)
    say(who, f"engine {model} TP=1 {plan.kv_dtype} KV: {session.setup_text}")
    p = decode_point(bench, session, ctx, plan.decode_reps, plan.decode_tokens, who)
    weights = shard_bytes(preset(model), 1, False, 1, 2) - (0 if cfg.tie_word_embeddings
                                                             else cfg.vocab_size * cfg.hidden_size * 2)
    read = (weights + (ctx + plan.decode_tokens / 2) * shapes.kv_bytes_per_token(cfg, plan.kv_dtype)
            + shapes.state_bytes_per_step(cfg))
    bw, _ = bench.roofline()
    if bw:
        p["floor_ms"] = read / bw * 1e3
        p["roofline_fraction"] = p["floor_ms"] / p["ms_per_round_median"]
    sec.update(model=model, bytes_per_step=read, point=p)
    _long_context(bench, session, plan, cfg, 1, sec, key, who)
    bench.save()
    bench.pool.close()
