"""Quantized weights against bf16 on the same run: each plan shape (qwen3-8b, qwen3-32b) in bf16,
FP8 (128x128 blocks) and NVFP4 (and INT4 weight-only in groups of 128 with `--quant-formats ...,w4a16`),
random weights made on the device and quantized there by the quantize tool's own quantizer
(`engine.quant.random_weights`), loaded through the engine's loader: decode batch 1 and batch 8 at a short
context (k = 0), and a fresh-prompt prefill of P tokens in one chunk. Speed does not depend on the values;
quality is tools/quality/quant_quality.py's.

Then the seed's one-GPU deployment (`seed_shape`, qwen3-32b): NVFP4 weights, int8 KV, one GPU, a
192k-token prompt and 512 decoded tokens, with a decode point against its floor -- the hybrid
section's one-GPU code (tools/bench/hybrid.py) on the dense shape; headline `seed_32b_nvfp4_one_gpu_192k_ok`.

The decode roofline fraction of a format is the bytes one step reads -- the linear layers in that
format (packed values and scales), lm_head in bf16, the KV at the context -- over the measured copy
bandwidth, divided by the measured time per step.
"""

from __future__ import annotations

from dataclasses import replace

from engine.sampling_params import SamplingParams
from tools.bench import hybrid, shapes
from tools.bench.decode import decode_point, seconds_per_token, tokens_for
from tools.bench.progress import fmt_rate, say
from tools.bench.session import compact, random_prompt

FORMATS = ("bf16", "fp8", "nvfp4", "w4a16")     # w4a16: INT4 groups of 128 (compressed-tensors), by --quant-formats


def decode_bytes(shape: str, fmt: str, context: float) -> float:
    """Bytes one k=0 batch-1 step reads: every parameter but the embedding table, each in its stored
    dtype (bf16 for the rest), plus the KV at `context`."""
    from engine.worker.memory_plan import shard_bytes
    from engine.loading.presets import preset
    cfg = preset(shape if fmt == "bf16" else f"{shape}-{fmt}")
    weights = shard_bytes(cfg, 1, False, 1, 2)
    weights -= cfg.vocab_size * cfg.hidden_size * 2 if not cfg.tie_word_embeddings else 0
    return weights + context * shapes.kv_bytes_per_token(replace(cfg, quant=None), "bfloat16")


def _engine(bench, shape: str, fmt: str):
    plan = bench.plan.quant
    model = f"preset:{shape}" + ("" if fmt == "bf16" else f"-{fmt}")
    spec = bench.engine_spec(model=model, draft_tokens=0, prefill_chunk=plan.prefill_P, kv_capacity=plan.kv_capacity,
                             max_model_len=plan.kv_capacity, max_batch=max(8, plan.streams))
    return bench.pool.get(spec, warm_prompt=plan.context, warm_decode=16)


def run(bench, sec: dict) -> None:
    plan = bench.plan.quant
    points = sec.setdefault("points", [])
    bw, _ = bench.roofline()
    for shape in plan.shapes:
        for fmt in [f for f in FORMATS if f in plan.formats]:
            first = bench.build_guess_s() + 5.0
            if not bench.budget.allows(first):
                points.append({"shape": shape, "format": fmt, "skipped": bench.budget.skip_reason(first)})
                say("quant", f"{shape} {fmt}: skipped ({bench.budget.skip_reason(first)})")
                continue
            session, _ = _engine(bench, shape, fmt)
            say("quant", f"engine {shape} {fmt}: {session.setup_text}")
            point = {"shape": shape, "format": fmt, "engine": session.describe}
            s_tok = seconds_per_token(session, plan.context)
            b1 = decode_point(bench, session, plan.context, plan.repeats, tokens_for(bench.plan.decode, s_tok), "quant")
            point["decode_b1"] = {k: b1[k] for k in ("decode_tok_s_peak", "decode_tok_s_median", "ms_per_round_best",
                                                     "max_tokens", "context")}
            steps = decode_bytes(shape, fmt, plan.context + b1["max_tokens"] / 2)
            point["decode_bytes_per_step"] = steps
            if bw and b1.get("ms_per_round_best"):
                point["decode_b1"]["roofline_fraction"] = steps / bw / (b1["ms_per_round_best"] / 1e3)
            batches = []
            sp = SamplingParams(max_tokens=plan.batch_tokens, ignore_eos=True, temperature=0.0)
            for _ in range(0 if plan.decode_only else plan.batch_repeats):
                if not bench.budget.allows(2 * plan.batch_tokens * s_tok):
                    break
                stats = session.generate_many([random_prompt(plan.context, session.vocab) for _ in range(plan.streams)],
                                              [sp] * plan.streams)
                batches.append([compact(s)["decode_tok_s"] for s in stats])
            if batches:
                best = max(batches, key=sum)
                point["decode_b8"] = {"streams": plan.streams, "aggregate_tok_s": sum(best),
                                      "aggregate_tok_s_per_batch": [sum(b) for b in batches], "per_stream_tok_s": best}
            reps = []
            for _ in range(0 if plan.decode_only else plan.prefill_repeats):
                if not bench.budget.allows(bench.estimate_prefill_s(plan.prefill_P) * 2):
                    break
                stats = session.generate(random_prompt(plan.prefill_P, session.vocab), SamplingParams(max_tokens=1, temperature=0.0))
                reps.append(compact(stats)["prefill_tok_s"])
            if reps:
                point["prefill"] = {"P": plan.prefill_P, "chunk": plan.prefill_P, "tok_s_peak": max(reps), "tok_s": reps}
            points.append(point)
            say("quant", f"{shape} {fmt}: decode b1 {fmt_rate(b1['decode_tok_s_peak'])} "
                         f"({point['decode_b1'].get('roofline_fraction') or 0:.2f} of roofline), b{plan.streams} "
                         f"{fmt_rate((point.get('decode_b8') or {}).get('aggregate_tok_s'))}, prefill "
                         f"{fmt_rate((point.get('prefill') or {}).get('tok_s_peak'))}")
            bench.save()
    if plan.shapes:
        _ratios(sec, plan.shapes[0])
    if plan.seed_shape:
        seed_plan = replace(bench.plan.hybrid, shape=plan.seed_shape, one_gpu_format="nvfp4")
        hybrid.one_gpu_deployment(bench, sec.setdefault("seed_one_gpu", {}), seed_plan,
                                  shapes.model_config(plan.seed_shape), "seed_32b_nvfp4_one_gpu_192k_ok", "quant")
    sec["status"] = "ok"


def _ratios(sec: dict, shape: str) -> None:
    """Each shape's format-over-bf16 ratios, and the headline figures of the first shape."""
    by = {(p["shape"], p["format"]): p for p in sec.get("points", []) if "skipped" not in p}
    sec["ratios"] = {}
    for (s, fmt), p in by.items():
        base = by.get((s, "bf16"))
        if fmt == "bf16" or base is None:
            continue
        r = {}
        for key, path in (("decode_b1", ("decode_b1", "decode_tok_s_peak")),
                          ("decode_b8", ("decode_b8", "aggregate_tok_s")), ("prefill", ("prefill", "tok_s_peak"))):
            a, b = (p.get(path[0]) or {}).get(path[1]), (base.get(path[0]) or {}).get(path[1])
            r[key] = a / b if a and b else None
        sec["ratios"][f"{s} {fmt}"] = r
    names = {"nvfp4_over_bf16_decode_b1": ("nvfp4", "decode_b1"), "fp8_over_bf16_decode_b1": ("fp8", "decode_b1"),
             "fp8_over_bf16_prefill_4k": ("fp8", "prefill"), "w4a16_over_bf16_decode_b1": ("w4a16", "decode_b1")}
    for name, (fmt, key) in names.items():
        v = sec["ratios"].get(f"{shape} {fmt}", {}).get(key)
        if v is not None:
            sec[name] = v
            sec[name + "_inputs"] = {"shape": shape, "format": fmt}
        else:
            sec[name + "_reason"] = f"no {fmt} and bf16 {key} pair on {shape}"
    for fmt in ("fp8", "nvfp4"):
        frac = (by.get((shape, fmt), {}).get("decode_b1") or {}).get("roofline_fraction")
        name = f"{fmt}_decode_b1_roofline_fraction"
        if frac is not None:
            sec[name] = frac
            sec[name + "_inputs"] = {"shape": shape, "bytes_per_step": by[(shape, fmt)]["decode_bytes_per_step"]}
        else:
            sec[name + "_reason"] = f"no {fmt} decode point with a roofline on {shape}"
