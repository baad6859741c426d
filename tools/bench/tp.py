"""Tensor parallelism (two GPUs): TP2 against TP1 on the main shape, the large shape's TP2 roofline
fraction, and one 192k-token context on the large shape with int8 KV.

TP1 and TP2 engines are held together and take turns (tp1, tp2, tp1, tp2, ...; tools/bench/interleave.py)
on each figure of `pairs`: decode batch 1 at the plan's context, `streams` streams decoding together
(parked after prefill, resumed in one command; aggregate = the sum of the streams' decode rates), and
the prefill of a fresh prompt of each planned length alone. derive.py takes the medians of the per-rep
ratios: `tp2_over_tp1_decode_b1`, `tp2_over_tp1_agg_8`, `tp2_over_tp1_prefill_512`. On CUDA the kernels
per decode round of each engine are counted by the profiler. A before/after of an engine switch
(`NINFER_TP_FUSED_NORM=0`, ...) is two runs of this section with and without it.

Runs only with >= 2 GPUs and an engine that really shards: after building a TP2 engine the second
GPU must hold a good share of the weights (an engine that accepts `tensor_parallel_size=2` but
places nothing on cuda:1 is recorded as unsupported, not measured). On the CPU the section is a dry
run of the same code with two in-process ranks at the tiny shape.
"""

from __future__ import annotations

import torch

from engine.errors import InvalidArgumentError
from engine.sampling_params import SamplingParams
from tools.bench import interleave, shapes
from tools.bench.concurrency import streams_point
from tools.bench.decode import decode_point, decode_rep, point_from_reps, seconds_per_token, tokens_for
from tools.bench.progress import fmt_rate, say
from tools.bench.session import compact, random_prompt

GiB = 1 << 30


def _skip(sec: dict, reason: str) -> None:
    sec["status"] = "skipped"
    sec["reason"] = reason
    say("tp", f"skipped: {reason}")


def _free(idx: int) -> int:
    return torch.cuda.mem_get_info(idx)[0]


def kernels_per_round(session, context: int, tokens: int = 24) -> dict:
    """Kernels per decode round on each device (batch 1, k = 0), counted by the profiler over one
    request's decode after its prefill (parked, then resumed under the profiler)."""
    from torch.profiler import ProfilerActivity, profile
    stream = session.submit(random_prompt(context, session.vocab), SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0),
                            park=True)
    stream.next(timeout=120)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        session.loop.resume_all([stream.request_id])
        stats = session.wait(stream, 120)
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)
    rounds = stats.usage.completion_tokens - 1
    counts: dict[int, int] = {}
    for ev in prof.events():
        if (ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0
                and not ev.name.startswith(("Memcpy", "Memset"))):
            counts[ev.device_index] = counts.get(ev.device_index, 0) + 1
    return {f"cuda:{d}": n / rounds for d, n in sorted(counts.items())}


def _prefill_rep(session, P: int, timeout: float) -> dict:
    r = compact(session.generate(random_prompt(P, session.vocab), SamplingParams(max_tokens=1, temperature=0.0), timeout=timeout))
    return {k: r[k] for k in ("prefill_tok_s", "ttft_s", "computed_prefill_tokens", "cached_tokens", "prefill_chunk")}


def run(bench, sec: dict) -> None:
    plan = bench.plan.tp
    cuda = bench.kind == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        return _skip(sec, f"needs 2 GPUs, found {torch.cuda.device_count()}")
    if not cuda:
        sec["note"] = "CPU dry run: two ranks in one process; not GPU figures"
    points = sec.setdefault("points", [])
    ctx = plan.context
    specs = {"tp1": bench.engine_spec(draft_tokens=0), "tp2": bench.engine_spec(draft_tokens=0, tensor_parallel_size=2)}
    tp1, _ = bench.pool.get(specs["tp1"], warm_prompt=ctx, warm_decode=32, keep=(specs["tp2"],))
    before = _free(1) if cuda else 0
    try:
        tp2, _ = bench.pool.get(specs["tp2"], warm_prompt=ctx, warm_decode=32, keep=(specs["tp1"],))
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
    sessions = {"tp1": tp1, "tp2": tp2}
    s_tok = seconds_per_token(tp1, ctx)
    max_tokens = tokens_for(bench.plan.decode, s_tok)
    pairs = sec.setdefault("pairs", {})

    def compare(name: str, one_s: float, rep, **fields) -> dict | None:
        if not bench.budget.allows(2 * one_s):
            pairs[name] = {"skipped": bench.budget.skip_reason(2 * one_s)}
            return None
        pairs[name] = pair = interleave.run({label: (lambda s=s: rep(s)) for label, s in sessions.items()}, plan.reps,
                                            bench.budget, 2 * one_s, tensor_parallel_size={"tp1": 1, "tp2": 2},
                                            **fields)
        bench.save()
        return pair

    one = bench.estimate_prefill_s(ctx) + max_tokens * s_tok
    pair = compare("decode_b1", one, lambda s: decode_rep(bench, s, ctx, max_tokens), context=ctx, max_tokens=max_tokens)
    if pair:
        for label, s in sessions.items():
            points.append({**point_from_reps(pair["reps"][label], ctx, max_tokens, s.describe, "tp"),
                           "label": label, "shape": bench.shape})
    n = plan.streams
    stream_tokens = min(max_tokens, bench.plan.kv_capacity // n - ctx - 16)
    one = n * bench.estimate_prefill_s(ctx) + stream_tokens * s_tok * (1 + 0.15 * n)
    compare("streams", one, lambda s: streams_point(s, n, ctx, stream_tokens, timeout=max(120.0, 10 * one)),
            streams=n, context=ctx, max_tokens=stream_tokens)
    for P in plan.prefill_prompts:
        one = bench.estimate_prefill_s(P)
        compare(f"prefill_{P}", one, lambda s, P=P: _prefill_rep(s, P, max(120.0, 5 * one)), P=P,
                chunk=tp1.describe.get("prefill_chunk"))
    for name, pair in pairs.items():
        metric = {"decode_b1": "decode_tok_s", "streams": "aggregate_tok_s"}.get(name, "prefill_tok_s")
        r = interleave.reduce_pair(pair if "sides" in pair else None, "tp2", "tp1", metric)
        say("tp", f"TP2 / TP1 {name}: {r['value'] or 0:.3f} ({r['reps']} reps{', ' + pair['skipped'] if 'skipped' in pair else ''})")
    if cuda:
        try:
            sec["kernels_per_round"] = {label: kernels_per_round(s, ctx) for label, s in sessions.items()}
        except Exception as e:  # noqa: BLE001 - the timings above stand without the count
            sec["kernels_per_round_error"] = repr(e)[:300]
    bench.pool.close()
    _big_shape(bench, sec, plan, points, ctx)


def _big_shape(bench, sec: dict, plan, points: list, ctx: int) -> None:
    """The large shape at TP2, int8 KV sized for the long context: decode b1 against its floor, then
    the long context (prompt + decoded tokens = plan.long_context)."""
    big = shapes.model_config(plan.big_shape)
    cap = plan.long_context + 64
    spec = bench.engine_spec(model=f"preset:{plan.big_shape}", draft_tokens=0, tensor_parallel_size=2,
                             kv_dtype="int8", kv_capacity=cap, max_model_len=cap)
    if not bench.budget.allows(bench.build_guess_s() * 2):
        sec["tp2_32b_roofline_fraction_reason"] = sec["context_192k_ok_reason"] = bench.budget.skip_reason(
            bench.build_guess_s() * 2)
        sec["status"] = "ok"
        return
    session, _ = bench.pool.get(spec, warm_prompt=ctx, warm_decode=32)
    s_tok = seconds_per_token(session, ctx)
    p3 = decode_point(bench, session, ctx, plan.reps, tokens_for(bench.plan.decode, s_tok), "tp")
    points.append({**p3, "label": "tp2-big", "shape": plan.big_shape})
    bench.save()                                           # derive sets the point's roofline fractions

    n_dec = plan.long_decode_tokens
    P = plan.long_context - n_dec
    est = bench.estimate_prefill_s(P, cfg=big) / 2 + n_dec * s_tok * 2
    if not bench.budget.allows(est):
        sec["context_192k_ok_reason"] = bench.budget.skip_reason(est)
        say("tp", f"long context skipped ({sec['context_192k_ok_reason']})")
        sec["status"] = "ok"
        return
    try:
        stats = compact(session.generate(random_prompt(P, session.vocab),
                                         SamplingParams(max_tokens=n_dec, ignore_eos=True, temperature=0.0), timeout=max(300.0, 3 * est)))
    except Exception as e:  # noqa: BLE001 - the figure is whether it works
        sec["long_context"] = {"prompt_tokens": P, "error": repr(e)[:400], "tensor_parallel_size": 2}
        sec["context_192k_ok"] = False
        sec["context_192k_ok_inputs"] = sec["long_context"]
        sec["status"] = "ok"
        return
    ok = (stats["computed_prefill_tokens"] == P and stats["completion_tokens"] == n_dec
          and stats["finish_reason"] == "length")
    sec["long_context"] = {**stats, "context": P + n_dec, "shape": plan.big_shape, "kv_dtype": "int8",
                           "engine": session.describe}
    sec["context_192k_ok"] = ok
    sec["context_192k_ok_inputs"] = {"shape": plan.big_shape, "tensor_parallel_size": 2, "prompt_tokens": P,
                                     "decoded": stats["completion_tokens"], "prefill_tok_s": stats["prefill_tok_s"],
                                     "decode_tok_s": stats["decode_tok_s"]}
    say("tp", f"{P + n_dec}-token context on {plan.big_shape} TP2 int8: {'ok' if ok else 'FAILED'} "
              f"(prefill {fmt_rate(stats['prefill_tok_s'])}, decode {fmt_rate(stats['decode_tok_s'])})")
    sec["status"] = "ok"
