"""Concurrency: N streams decoding together (k=0), the TTFT of N prompts arriving together
(`tools.bench.burst`), and a long prefill arriving while a stream decodes.

N streams: each request is submitted with `park_after_prefill` (the one prefill lane packs them
while nothing decodes), then all N are resumed in one command on the engine thread,
so they decode together from the same step and, with equal `max_tokens`, finish together: the
overlap the seed needed 6000-token outputs to get. Per stream: its own `decode_tok_s`; aggregate =
the sum over streams (the seed's 合计), with a client wall-clock cross-check
(sum of decoded tokens / time from resume to the last stream's end). The stream counts take turns,
round by round (N = 1, 2, 8, 1, 2, 8, ...; `order`), for `reps` rounds: `agg_decode_N_streams` is the
median of the per-round ratios aggregate(N) / aggregate(1) (derive.py).

Prefill interference: one stream decodes; once it has produced a few tokens a long prompt is
submitted. The stream must get a token between any two chunks of that prompt (one step = one
chunk + the decode round that shares it): `ok` when the gaps longer than twice the stream's usual
gap are at least as many as the chunks, i.e. no gap held two chunks. Chunks late in a long prompt
attend to more context, so their gaps grow: the longest gap is reported beside the mean chunk but
is not the criterion (the first H200 run's gaps went 107, 138, ... 301 ms over 8 chunks: one each).
"""

from __future__ import annotations

import math
import statistics
import threading
import time

from engine.sampling_params import SamplingParams
from tools.bench.burst import ttft_burst
from tools.bench.decode import speed_from_warmup, tokens_for
from tools.bench.progress import fmt_rate, say
from tools.bench.session import compact, random_prompt


def run(bench, sec: dict) -> None:
    plan = bench.plan.concurrency
    points = sec.setdefault("points", [])
    session, reused = bench.pool.get(bench.engine_spec(draft_tokens=0), warm_prompt=plan.context, warm_decode=32)
    say("concurrency", "engine " + ("reused" if reused else session.setup_text))
    n_max = max(plan.streams)
    ctx = plan.context
    # warm the batched shapes, then time one stream briefly to size the requests
    session.generate_many([random_prompt(ctx, session.vocab) for _ in range(n_max)],
                          [SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)] * n_max)
    s_tok = speed_from_warmup(session.generate(random_prompt(ctx, session.vocab),
                                               SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)))
    max_tokens = min(tokens_for(plan, s_tok), bench.plan.kv_capacity // n_max - ctx - 16)
    sec["setup"] = {"context": ctx, "max_tokens": max_tokens, "draft_tokens": 0, "engine": session.describe}
    est = {n: n * bench.estimate_prefill_s(ctx) + max_tokens * s_tok * (1 + 0.15 * n) for n in plan.streams}
    reps: dict[int, list[dict]] = {n: [] for n in plan.streams}
    order, skipped = [], {}
    for i in range(plan.reps):
        for n in plan.streams:
            if n in skipped:
                continue
            if not bench.budget.allows(est[n]):
                skipped[n] = bench.budget.skip_reason(est[n])
                say("concurrency", f"N={n}: {'skipped' if not reps[n] else 'stopped'} ({skipped[n]})")
                continue
            reps[n].append(streams_point(session, n, ctx, max_tokens, timeout=max(120.0, 10 * est[n])))
            order.append(n)
    sec["order"] = order
    for n in plan.streams:
        if not reps[n]:
            points.append({"streams": n, "skipped": skipped.get(n, "not measured")})
            continue
        med = {key: statistics.median(r[key] for r in reps[n])
               for key in ("per_stream_tok_s_mean", "aggregate_tok_s", "wall_aggregate_tok_s")}
        points.append({"streams": n, "context": ctx, "max_tokens": max_tokens, **med, "reps": reps[n]})
        say("concurrency", f"N={n}: {fmt_rate(med['per_stream_tok_s_mean'])} per stream, "
                           f"{fmt_rate(med['aggregate_tok_s'])} aggregate (wall {fmt_rate(med['wall_aggregate_tok_s'])}), "
                           f"median of {len(reps[n])}")
    bench.save()

    est = (plan.burst_streams + 1) * plan.burst_repeats * bench.estimate_prefill_s(plan.burst_prompt) * 2 + 1.0
    if bench.budget.allows(est):
        sec["ttft_burst"] = b = ttft_burst(session, plan.burst_streams, plan.burst_prompt, plan.burst_repeats,
                                           timeout=max(120.0, 10 * est))
        say("concurrency", f"TTFT of {b['streams']} x {b['prompt']}-token prompts together: median "
                           f"{b['burst_ttft_s_median'] * 1e3:.1f} ms, alone {b['single_ttft_s_median'] * 1e3:.1f} ms "
                           f"-> {b['over_single']:.2f}x, median of {b['repeats']} rounds (chunk {b['prefill_chunk']})")
        bench.save()
    else:
        sec["ttft_burst"] = {"skipped": bench.budget.skip_reason(est)}

    est = bench.estimate_prefill_s(plan.interference_prompt) * 2 + 2.0
    if bench.budget.allows(est):
        sec["prefill_interference"] = interference(bench, session, ctx, plan.interference_prompt, s_tok)
        i = sec["prefill_interference"]
        say("concurrency", f"prefill of P={i['long_prompt']} ({i['chunks']} chunks of {i['chunk']}) mid-decode: "
                           f"the stream waited {i['chunk_gaps']} times (longest {i['max_gap_ms']:.1f} ms, mean "
                           f"chunk {i['chunk_ms']:.1f} ms) -> {'ok: one chunk per wait' if i['ok'] else 'STALLED'}")
    else:
        sec["prefill_interference"] = {"skipped": bench.budget.skip_reason(est)}
    sec["status"] = "ok"


def streams_point(session, n: int, ctx: int, max_tokens: int, timeout: float) -> dict:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    streams = [session.submit(random_prompt(ctx, session.vocab), params, park=True) for _ in range(n)]
    for s in streams:                     # the first token arrives when its prefill ends; then it parks
        s.next(timeout=timeout)
    ids = [s.request_id for s in streams]
    t0 = time.monotonic()
    session.loop.resume_all(ids)
    reps = [compact(session.wait(s, timeout)) for s in streams]
    wall = time.monotonic() - t0
    rates = [r["decode_tok_s"] for r in reps]
    decoded = sum(r["completion_tokens"] - 1 for r in reps)
    return {"streams": n, "context": ctx, "max_tokens": max_tokens, "per_stream_tok_s": rates,
            "per_stream_tok_s_mean": statistics.mean(rates), "aggregate_tok_s": sum(rates),
            "wall_aggregate_tok_s": decoded / wall if wall > 0 else None, "wall_s": wall, "repeats": reps}


def interference(bench, session, ctx: int, long_prompt: int, s_tok: float) -> dict:
    lead = 16                                     # tokens the stream produces before the prompt arrives
    prefill_s = max(bench.estimate_prefill_s(long_prompt), 0.5)
    room = bench.plan.kv_capacity - long_prompt - ctx - 16
    max_tokens = max(lead + 8, min(room, int(lead + (1.5 * prefill_s + 1.0) / max(s_tok, 1e-4))))
    times: list[float] = []
    result: dict = {}

    def consume(stream):
        try:
            result["stats"] = compact(session.wait(stream, timeout=600, on_output=lambda t, out: times.append(t)))
        except Exception as e:  # noqa: BLE001 - reported below
            result["error"] = repr(e)

    stream = session.submit(random_prompt(ctx, session.vocab), SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    reader = threading.Thread(target=consume, args=(stream,), daemon=True)
    reader.start()
    while len(times) < lead and reader.is_alive():
        time.sleep(0.001)
    t_submit = time.monotonic()
    long = compact(session.generate(random_prompt(long_prompt, session.vocab), SamplingParams(max_tokens=1, temperature=0.0),
                                    timeout=max(120.0, 10 * prefill_s)))
    t_done = time.monotonic()
    reader.join(timeout=600)
    gaps_before = [b - a for a, b in zip(times, times[1:]) if b <= t_submit]
    during = [(a, b) for a, b in zip(times, times[1:]) if b >= t_submit and a <= t_done]
    chunk = long["prefill_chunk"]
    chunk_ms = long["prefill_s"] / math.ceil(long["computed_prefill_tokens"] / chunk) * 1e3
    baseline_ms = statistics.median(gaps_before) * 1e3 if gaps_before else 0.0
    max_gap_ms = max((b - a for a, b in during), default=0.0) * 1e3
    covered = bool(times) and times[-1] >= t_done
    chunks = math.ceil(long["computed_prefill_tokens"] / chunk)
    chunk_gaps = sum(1 for a, b in during if (b - a) * 1e3 > 2 * baseline_ms)
    return {"long_prompt": long_prompt, "chunk": chunk, "chunks": chunks, "long_prefill_s": long["prefill_s"],
            "long_prefill_tok_s": long["prefill_tok_s"], "chunk_ms": chunk_ms, "baseline_gap_ms": baseline_ms,
            "max_gap_ms": max_gap_ms, "gap_over_chunk": max_gap_ms / chunk_ms if chunk_ms else None,
            "chunk_gaps": chunk_gaps, "ok": covered and chunk_gaps >= chunks,
            "stream_outlived_prefill": covered, "stream": result.get("stats"), "stream_error": result.get("error"),
            "gaps_during_ms": [round((b - a) * 1e3, 2) for a, b in during][:400]}
