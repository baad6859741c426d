"""Weight formats against bf16 on the same run, interleaved: each plan shape (qwen3-8b, qwen3-32b) in
bf16 and in each other format -- FP8 (128x128 blocks), NVFP4, INT4 weight-only (W4A16, group 128) and
fp16 (the portable path: the same shape in float16) -- with random weights made on the device and
quantized there by the quantize tool's own quantizer (`engine.quant.random_weights`), loaded through
the engine's loader. Speed does not depend on the values; quality is tools/quality/quant_quality.py's.

The bf16 engine is held while each format's engine is built; the two take turns (bf16, format, bf16,
...; `pairs`, tools/bench/interleave.py) on decode batch 1 and batch `streams` at a short context
(k = 0) and on a fresh-prompt prefill of P tokens in one chunk. derive.py takes the medians of the
per-rep ratios on the first shape: `nvfp4_over_bf16_decode_b1`, `fp8_over_bf16_decode_b1`,
`w4a16_over_bf16_decode_b1`, `fp16_over_bf16_decode_b1`, `fp8_over_bf16_prefill_4k`. A format whose
preset does not exist in this checkout is recorded as skipped, with the loader's reason.

Then, on the first shape, NVFP4 with MTP (k = `mtp_k`, the reduced draft vocabulary) against NVFP4
at k = 0 (`mtp_pair`): its ms per round and the acceptance section's prose acceptance give the
implied decode rate `nvfp4_mtp3_b1_implied_tok_s` (derive.py). Then the seed's one-GPU deployment
(`seed_shape`, qwen3-32b): NVFP4 weights, int8 KV, one GPU, a 192k-token prompt and 512 decoded tokens
(tools/bench/hybrid.py's one-GPU code on the dense shape); headline `seed_32b_nvfp4_one_gpu_192k_ok`.

The decode roofline fraction of a format is the bytes one step reads -- the linear layers in that
format (packed values and scales), lm_head in bf16, the KV at the context -- over the measured copy
bandwidth, divided by the measured time per step (per rep, then the median).
"""

from __future__ import annotations

from dataclasses import replace

from engine.errors import ModelLoadError
from tools.bench import hybrid, interleave, shapes
from tools.bench.concurrency import streams_point
from tools.bench.decode import decode_rep, seconds_per_token, tokens_for
from tools.bench.peer import engine_prefill
from tools.bench.progress import fmt_rate, say

FORMATS = ("bf16", "fp8", "nvfp4", "w4a16", "fp16")
DTYPE_FORMATS = {"fp16": "float16"}          # formats that are the bf16 shape in another engine dtype


def model_name(shape: str, fmt: str) -> str:
    return f"preset:{shape}" + ("" if fmt == "bf16" or fmt in DTYPE_FORMATS else f"-{fmt}")


def decode_bytes(shape: str, fmt: str, context: float) -> float:
    """Bytes one k=0 batch-1 step reads: every parameter but the embedding table, each in its stored
    dtype (16-bit for the rest), plus the 16-bit KV at `context`."""
    from engine.worker.memory_plan import shard_bytes
    from engine.loading.presets import preset
    cfg = preset(model_name(shape, fmt))
    weights = shard_bytes(cfg, 1, False, 1, 2)
    weights -= cfg.vocab_size * cfg.hidden_size * 2 if not cfg.tie_word_embeddings else 0
    return weights + context * shapes.kv_bytes_per_token(replace(cfg, quant=None), "bfloat16")


def _spec(bench, shape: str, fmt: str, draft_tokens: int = 0, draft_vocab: int = 0):
    plan = bench.plan.quant
    extra = (("dtype", DTYPE_FORMATS[fmt]),) if fmt in DTYPE_FORMATS else ()
    return bench.engine_spec(model=model_name(shape, fmt), draft_tokens=draft_tokens, draft_vocab=draft_vocab,
                             prefill_chunk=plan.prefill_P, kv_capacity=plan.kv_capacity, max_model_len=plan.kv_capacity,
                             max_batch=max(8, plan.streams), extra=extra)


def run(bench, sec: dict) -> None:
    plan = bench.plan.quant
    sec.setdefault("points", [])
    sec.setdefault("pairs", [])
    sec["headline_shape"] = plan.shapes[0] if plan.shapes else None
    for i, shape in enumerate(plan.shapes):
        _shape(bench, sec, shape, mtp=i == 0)
    if not plan.mtp_k:
        sec["mtp_reason"] = "not asked (mtp_k 0)"
    if not plan.seed_shape:
        sec["seed_one_gpu"] = {"reason": "not asked (no seed shape)"}
    else:
        seed_plan = replace(bench.plan.hybrid, shape=plan.seed_shape, one_gpu_format="nvfp4")
        hybrid.one_gpu_deployment(bench, sec.setdefault("seed_one_gpu", {}), seed_plan,
                                  shapes.model_config(plan.seed_shape), "seed_32b_nvfp4_one_gpu_192k_ok", "quant")
    sec["status"] = "ok"


def _shape(bench, sec: dict, shape: str, mtp: bool) -> None:
    plan = bench.plan.quant
    formats = [f for f in FORMATS if f in plan.formats and f != "bf16"]
    base_spec = _spec(bench, shape, "bf16")
    if not bench.budget.allows(bench.build_guess_s() + 5.0):
        sec["points"].append({"shape": shape, "format": "bf16", "skipped": bench.budget.skip_reason(bench.build_guess_s())})
        return
    base, _ = bench.pool.get(base_spec, warm_prompt=plan.context, warm_decode=16)
    say("quant", f"engine {shape} bf16: {base.setup_text}")
    s_tok = seconds_per_token(base, plan.context)
    tokens = tokens_for(bench.plan.decode, s_tok)
    sec["points"].append({"shape": shape, "format": "bf16", "engine": base.describe,
                          "decode_bytes_per_step": decode_bytes(shape, "bf16", plan.context + tokens / 2)})
    for fmt in formats:
        spec = _spec(bench, shape, fmt)
        try:
            shapes.model_config(model_name(shape, fmt).removeprefix("preset:"))
        except ModelLoadError as e:
            sec["points"].append({"shape": shape, "format": fmt, "skipped": f"no {model_name(shape, fmt)} here: {e}"[:300]})
            continue
        if not bench.budget.allows(bench.build_guess_s() + 5.0):
            sec["points"].append({"shape": shape, "format": fmt, "skipped": bench.budget.skip_reason(bench.build_guess_s())})
            continue
        keep = (base_spec,)
        other, _ = bench.pool.get(spec, warm_prompt=plan.context, warm_decode=16, keep=keep)
        say("quant", f"engine {shape} {fmt}: {other.setup_text}")
        sides = {"bf16": base, fmt: other}
        point = {"shape": shape, "format": fmt, "engine": other.describe,
                 "decode_bytes_per_step": decode_bytes(shape, fmt, plan.context + tokens / 2)}
        figures = {"decode_b1": lambda s: decode_rep(bench, s, plan.context, tokens)}
        if not plan.decode_only:
            figures["decode_b8"] = lambda s: streams_point(s, plan.streams, plan.context, plan.batch_tokens, timeout=300.0)
            figures["prefill"] = lambda s: engine_prefill(s, plan.prefill_P, timeout=300.0)
        for figure, rep in figures.items():
            pair = interleave.run({name: (lambda s=s: rep(s)) for name, s in sides.items()}, plan.reps, bench.budget,
                                  2 * (1.0 + tokens * s_tok), shape=shape, format=fmt, figure=figure,
                                  context=plan.context, tokens=tokens, P=plan.prefill_P, streams=plan.streams,
                                  tensor_parallel_size=1)
            sec["pairs"].append(pair)
        sec["points"].append(point)
        _say(sec, shape, fmt)
        bench.save()
        if mtp and fmt == "nvfp4" and plan.mtp_k:
            _mtp_pair(bench, sec, shape, spec, keep + (spec,), tokens)
    bench.pool.close()


def _mtp_pair(bench, sec: dict, shape: str, k0_spec, keep: tuple, tokens: int) -> None:
    """NVFP4 with MTP against NVFP4 at k = 0: the cost of a round with k drafts (the moonshot's step)."""
    plan = bench.plan.quant
    dv = bench.plan.decode.draft_vocab if bench.plan.decode.draft_vocab < bench.cfg.vocab_size else 0
    spec = _spec(bench, shape, "nvfp4", draft_tokens=plan.mtp_k, draft_vocab=dv)
    mtp, _ = bench.pool.get(spec, warm_prompt=plan.context, warm_decode=16, keep=keep)
    k0 = bench.pool.sessions[k0_spec]
    sec["mtp_pair"] = pair = interleave.run(
        {"k0": lambda: decode_rep(bench, k0, plan.context, tokens), "mtp": lambda: decode_rep(bench, mtp, plan.context, tokens)},
        plan.reps, shape=shape, format="nvfp4", k=plan.mtp_k, draft_vocab=dv, context=plan.context, tokens=tokens,
        tensor_parallel_size=1)
    ms = [r["decode_s"] / r["rounds"] * 1e3 for r in pair["reps"]["mtp"] if r["rounds"]]
    say("quant", f"{shape} nvfp4 k={plan.mtp_k} (draft vocab {dv or 'full'}): ms per round "
                 + " / ".join(f"{m:.3f}" for m in ms))
    bench.save()


def _say(sec: dict, shape: str, fmt: str) -> None:
    out = []
    for figure, metric in (("decode_b1", "decode_tok_s"), ("decode_b8", "aggregate_tok_s"), ("prefill", "prefill_tok_s")):
        pair = next((p for p in sec["pairs"] if (p["shape"], p["format"], p["figure"]) == (shape, fmt, figure)), None)
        if pair:
            r = interleave.reduce_pair(pair, fmt, "bf16", metric)
            med = interleave.reduce_values(interleave.values(pair, fmt, metric))["value"]
            out.append(f"{figure} {fmt_rate(med)} ({r['value'] or 0:.3f}x bf16, {r['reps']} reps)")
    say("quant", f"{shape} {fmt}: " + ", ".join(out))
