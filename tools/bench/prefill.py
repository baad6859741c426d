"""Prefill sweep: prompt length P x chunk size, one engine per chunk (the chunk is an engine setting).

Each request is a fresh random prompt (no prefix-cache hits) with max_tokens=1, so its whole life
is the prefill; the figure is the request's own `prefill_tok_s = computed_prefill_tokens /
timings.prefill`, always reported with P and the chunk. Peak = max over repeats, with the median.
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
        for P in prompts:
            repeats = plan.repeats.get(P, 1)
            one = bench.estimate_prefill_s(P)
            if not bench.budget.allows(one * repeats):
                repeats = max(1, int(bench.budget.left() // max(one, 1e-9)))
                if not bench.budget.allows(one):
                    points.append({"P": P, "chunk": chunk, "skipped": bench.budget.skip_reason(one)})
                    say("prefill", f"P={P} chunk={chunk}: skipped ({bench.budget.skip_reason(one)})")
                    continue
            reps = []
            for _ in range(repeats):
                stats = session.generate(random_prompt(P, session.vocab), SamplingParams(max_tokens=1, temperature=0.0),
                                         timeout=max(120.0, 5 * one))
                reps.append(compact(stats))
                bench.note_prefill_rate("engine", P, reps[-1]["prefill_tok_s"])
            rates = [r["prefill_tok_s"] for r in reps]
            s = summary(rates)
            point = {"P": reps[0]["computed_prefill_tokens"], "prompt_tokens": P, "chunk": chunk,
                     "prefill_tok_s_peak": s["peak"], "prefill_tok_s_median": s["median"],
                     "cached_tokens": max(r["cached_tokens"] for r in reps), "repeats": reps,
                     "engine": session.describe}
            points.append(point)
            say("prefill", f"P={P} chunk={chunk}: {fmt_rate(s['peak'])} peak, {fmt_rate(s['median'])} median "
                           f"of {len(rates)} (MFU {bench.mfu_text(P, s['peak'])})")
            bench.save()
    sec["status"] = "ok"
