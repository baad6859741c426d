"""Tensor parallelism (two GPUs): TP1 vs TP2 decode batch 1 on the main shape, the large shape's
TP2 roofline fraction, and one 192k-token context on the large shape with int8 KV.

Runs only with >= 2 GPUs and an engine that really shards: after building a TP2 engine the second
GPU must hold a good share of the weights (an engine that accepts `tensor_parallel_size=2` but
places nothing on cuda:1 is recorded as unsupported, not measured). On the CPU the section is a dry
run of the same code with two in-process ranks at the tiny shape.
"""

from __future__ import annotations

import torch

from engine.errors import InvalidArgumentError
from engine.sampling_params import SamplingParams
from tools.bench import shapes
from tools.bench.decode import decode_point, seconds_per_token, tokens_for
from tools.bench.progress import fmt_rate, say
from tools.bench.session import compact, random_prompt

GiB = 1 << 30


def _skip(sec: dict, reason: str) -> None:
    sec["status"] = "skipped"
    sec["reason"] = reason
    say("tp", f"skipped: {reason}")


def _free(idx: int) -> int:
    return torch.cuda.mem_get_info(idx)[0]


def _prefill_points(bench, sec: dict, session, label: str) -> None:
    """Prefill of fresh prompts of each planned length at the plan's chunk (max_tokens=1), peak of
    the repeats; with both labels measured, sec["tp2_over_tp1_prefill"][P] is their ratio."""
    rows = sec.setdefault("prefill", [])
    for P in bench.plan.tp.prefill_prompts:
        one = bench.estimate_prefill_s(P)
        if not bench.budget.allows(one * bench.plan.tp.repeats):
            rows.append({"label": label, "P": P, "skipped": bench.budget.skip_reason(one)})
            continue
        reps = [compact(session.generate(random_prompt(P, session.vocab), SamplingParams(max_tokens=1, temperature=0.0),
                                         timeout=max(120.0, 5 * one)))
                for _ in range(bench.plan.tp.repeats)]
        rates = [r["prefill_tok_s"] for r in reps]
        rows.append({"label": label, "P": P, "chunk": session.describe.get("prefill_chunk"),
                     "prefill_tok_s_peak": max(rates), "prefill_tok_s_all": rates})
        say("tp", f"{label} prefill P={P}: {fmt_rate(max(rates))}")
    peak = {(r["label"], r["P"]): r["prefill_tok_s_peak"] for r in rows if "prefill_tok_s_peak" in r}
    sec["tp2_over_tp1_prefill"] = {str(P): peak[("tp2", P)] / peak[("tp1", P)] for P in bench.plan.tp.prefill_prompts
                                   if ("tp1", P) in peak and ("tp2", P) in peak}
    bench.save()


def run(bench, sec: dict) -> None:
    plan = bench.plan.tp
    cuda = bench.kind == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        return _skip(sec, f"needs 2 GPUs, found {torch.cuda.device_count()}")
    if not cuda:
        sec["note"] = "CPU dry run: two ranks in one process; not GPU figures"
    points = sec.setdefault("points", [])
    ctx = plan.context

    # TP1 baseline: the decode sweep's k=0 figure at this context when it ran in this run
    base = None
    dec = bench.results["sections"].get("decode", {})
    if dec.get("run_id") == bench.results["run"]["run_id"]:
        base = next((p for p in dec.get("points", []) if p.get("draft_tokens") == 0 and not p.get("draft_vocab")
                     and p.get("context") == ctx and "repeats" in p), None)
    if base is None or plan.prefill_prompts:
        session, _ = bench.pool.get(bench.engine_spec(draft_tokens=0), warm_prompt=ctx, warm_decode=32)
        if base is None:
            base = decode_point(bench, session, ctx, plan.repeats,
                                tokens_for(bench.plan.decode, seconds_per_token(session, ctx)), "tp")
        _prefill_points(bench, sec, session, "tp1")
    points.append({**base, "label": "tp1", "shape": bench.shape})
    bench.pool.close()

    # TP2 on the main shape: does the engine shard at all?
    before = _free(1) if cuda else 0
    try:
        session, _ = bench.pool.get(bench.engine_spec(draft_tokens=0, tensor_parallel_size=2), warm_prompt=ctx,
                                    warm_decode=32)
    except (InvalidArgumentError, NotImplementedError) as e:     # the engine says it cannot; other errors are errors
        bench.pool.close()
        return _skip(sec, f"the engine refused tensor_parallel_size=2: {e}"[:400])
    used = before - _free(1) if cuda else None
    expect = shapes.weight_bytes_per_step(bench.cfg) / 2
    sec["cuda1_bytes_used_by_tp2_engine"] = used
    if cuda and used < 0.25 * expect:
        bench.pool.close()
        return _skip(sec, f"the engine accepted tensor_parallel_size=2 but cuda:1 holds only {used / GiB:.2f} GiB "
                          f"(half the weights are {expect / GiB:.1f} GiB): tensor parallelism is not in effect")
    p2 = decode_point(bench, session, ctx, plan.repeats, tokens_for(bench.plan.decode, seconds_per_token(session, ctx)),
                      "tp")
    points.append({**p2, "label": "tp2", "shape": bench.shape})
    _prefill_points(bench, sec, session, "tp2")
    sec["tp2_over_tp1_decode_b1"] = p2["decode_tok_s_peak"] / base["decode_tok_s_peak"]
    sec["tp2_over_tp1_decode_b1_inputs"] = {"context": ctx, "tp1_tok_s": base["decode_tok_s_peak"],
                                            "tp2_tok_s": p2["decode_tok_s_peak"]}
    say("tp", f"TP2 / TP1 decode b1 ({bench.shape}, ctx {ctx}): {sec['tp2_over_tp1_decode_b1']:.2f}x")
    bench.save()
    bench.pool.close()

    # the large shape at TP2, int8 KV sized for the long context
    big = shapes.model_config(plan.big_shape)
    cap = plan.long_context + 64
    spec = bench.engine_spec(model=f"preset:{plan.big_shape}", draft_tokens=0, tensor_parallel_size=2,
                             kv_dtype="int8", kv_capacity=cap, max_model_len=cap)
    if not bench.budget.allows(bench.build_guess_s() * 2):
        sec["tp2_32b_roofline_fraction_reason"] = sec["context_192k_ok_reason"] = bench.budget.skip_reason(
            bench.build_guess_s() * 2)
        return
    session, _ = bench.pool.get(spec, warm_prompt=ctx, warm_decode=32)
    s_tok = seconds_per_token(session, ctx)
    p3 = decode_point(bench, session, ctx, plan.repeats, tokens_for(bench.plan.decode, s_tok), "tp")
    p3 = {**p3, "label": "tp2-big", "shape": plan.big_shape}
    points.append(p3)
    bench.save()                                           # derive sets the point's roofline fraction
    frac = p3.get("roofline_fraction")
    if frac is not None:
        sec["tp2_32b_roofline_fraction"] = frac
        sec["tp2_32b_roofline_fraction_inputs"] = {"shape": plan.big_shape, "context": ctx, "kv_dtype": "int8",
                                                   "floor_ms": p3.get("floor_ms"), "ms_per_token": p3["ms_per_round_best"]}
        say("tp", f"{plan.big_shape} TP2 decode b1: {fmt_rate(p3['decode_tok_s_peak'])}, {frac:.2f} of its roofline")
    else:
        sec["tp2_32b_roofline_fraction_reason"] = "no roofline measured in this run"

    # one long context: prompt + decoded tokens = plan.long_context
    n_dec = plan.long_decode_tokens
    P = plan.long_context - n_dec
    est = bench.estimate_prefill_s(P, cfg=big) / 2 + n_dec * s_tok * 2
    if not bench.budget.allows(est):
        sec["context_192k_ok_reason"] = bench.budget.skip_reason(est)
        say("tp", f"long context skipped ({sec['context_192k_ok_reason']})")
        return
    try:
        stats = compact(session.generate(random_prompt(P, session.vocab),
                                         SamplingParams(max_tokens=n_dec, ignore_eos=True, temperature=0.0), timeout=max(300.0, 3 * est)))
    except Exception as e:  # noqa: BLE001 - the figure is whether it works
        sec["long_context"] = {"prompt_tokens": P, "error": repr(e)[:400]}
        sec["context_192k_ok"] = False
        sec["context_192k_ok_inputs"] = sec["long_context"]
        return
    ok = (stats["computed_prefill_tokens"] == P and stats["completion_tokens"] == n_dec
          and stats["finish_reason"] == "length")
    sec["long_context"] = {**stats, "context": P + n_dec, "shape": plan.big_shape, "kv_dtype": "int8",
                           "engine": session.describe}
    sec["context_192k_ok"] = ok
    sec["context_192k_ok_inputs"] = {"prompt_tokens": P, "decoded": stats["completion_tokens"],
                                     "prefill_tok_s": stats["prefill_tok_s"], "decode_tok_s": stats["decode_tok_s"]}
    say("tp", f"{P + n_dec}-token context on {plan.big_shape} TP2 int8: {'ok' if ok else 'FAILED'} "
              f"(prefill {fmt_rate(stats['prefill_tok_s'])}, decode {fmt_rate(stats['decode_tok_s'])})")
    sec["status"] = "ok"
