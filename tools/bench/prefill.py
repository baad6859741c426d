"""Prefill sweep: prompt length P x chunk size, one engine per chunk (the chunk is an engine setting).

Each request is a fresh random prompt (no prefix-cache hits) with max_tokens=1, so its whole life
is the prefill; the figure is the request's own `prefill_tok_s = computed_prefill_tokens /
timings.prefill`, always reported with P and the chunk. The repeats of one chunk's prompt lengths are
interleaved -- round i measures rep i of every P that asks for that many (4k, 32k, 4k, 32k, ...;
`order` records it) -- so that the headline's `prefill_32k_over_4k` is the median of per-round ratios
and `prefill_4k_mfu` the median of the reps' MFU (derive.py). Peak (max) and median for the tables.
The engine of the plan's shared chunk runs last so that the sections after reuse it.
"""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from tools.bench.progress import fmt_rate, say
from tools.bench.session import compact, random_prompt
from tools.bench.timing import summary


def run(bench, sec: dict) -> None:
    plan = bench.plan.prefill
    points = sec.setdefault("points", [])
    chunks = sorted(c for c in plan.grid if c != bench.plan.chunk) + [c for c in plan.grid if c == bench.plan.chunk]
    for chunk in chunks:
        prompts = sorted(plan.grid[chunk])
        first = bench.build_guess_s() + bench.estimate_prefill_s(prompts[0])
        if not bench.budget.allows(first):
            for P in prompts:
                points.append({"P": P, "chunk": chunk, "skipped": bench.budget.skip_reason(first)})
            say("prefill", f"chunk {chunk}: skipped ({bench.budget.skip_reason(first)})")
            continue
        session, reused = bench.pool.get(bench.engine_spec(prefill_chunk=chunk),
                                         warm_prompt=min(2 * chunk, max(prompts)), warm_decode=2)
        say("prefill", f"engine chunk={chunk}: " + ("reused" if reused else
                                                     session.setup_text))
        rounds = max(plan.repeats.get(P, 1) for P in prompts)
        reps: dict[int, list[dict]] = {P: [] for P in prompts}
        order, skipped = [], {}
        for i in range(rounds):
            for P in prompts:
                if i >= plan.repeats.get(P, 1) or P in skipped:
                    continue
                one = bench.estimate_prefill_s(P)
                if not bench.budget.allows(one):
                    skipped[P] = bench.budget.skip_reason(one)
                    say("prefill", f"P={P} chunk={chunk}: {'skipped' if not reps[P] else 'stopped'} ({skipped[P]})")
                    continue
                stats = session.generate(random_prompt(P, session.vocab), SamplingParams(max_tokens=1, temperature=0.0),
                                         timeout=max(120.0, 5 * one))
                reps[P].append(compact(stats))
                order.append(P)
                bench.note_prefill_rate("engine", P, reps[P][-1]["prefill_tok_s"])
        sec.setdefault("order", {})[str(chunk)] = order
        for P in prompts:
            if not reps[P]:
                points.append({"P": P, "chunk": chunk, "skipped": skipped.get(P, "not measured")})
                continue
            rates = [r["prefill_tok_s"] for r in reps[P]]
            s = summary(rates)
            point = {"P": reps[P][0]["computed_prefill_tokens"], "prompt_tokens": P, "chunk": chunk,
                     "prefill_tok_s_peak": s["peak"], "prefill_tok_s_median": s["median"],
                     "cached_tokens": max(r["cached_tokens"] for r in reps[P]), "repeats": reps[P],
                     "engine": session.describe}
            points.append(point)
            say("prefill", f"P={P} chunk={chunk}: {fmt_rate(s['median'])} median of {len(rates)}, {fmt_rate(s['peak'])} "
                           f"peak (MFU {bench.mfu_text(P, s['median'])})")
        bench.save()
    sec["status"] = "ok"
