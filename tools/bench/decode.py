"""Decode sweep: draft tokens k x context, batch 1, plus the reduced draft vocabulary at one k.

k is an engine setting (the runner drafts the engine's k whatever a request asks), so each k gets
its own engine; the contexts reuse it. The cost of a draft round is measured against k = 0 on
engines held together: at the reference context each k's engine and the k = 0 engine take turns
(k0, k, k0, k, ...; `round_cost_pairs`), and `extra_draft_cost_fraction` is derived from the
per-rep ratios (derive.py). The k = 0 engine's own sweep point at that context (three reps) gives
`decode_b1_roofline_fraction`. Requests run with `ignore_eos` and enough `max_tokens` that
rounds dominate (sized from the warm-up's speed to about `target_decode_s`), greedy.

Per request: `decode_tok_s = (completion_tokens - 1) / timings.decode` and
`ms_per_round = timings.decode / speculative.rounds` (k = 0: rounds = completion_tokens - 1), with
the acceptance per position `accepted_per_position[i] / rounds`. On random weights acceptance is
near zero: the large shapes give the cost of a round, the trained small model gives acceptance
(see `acceptance.py`, which combines the two).
"""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from tools.bench import interleave
from tools.bench.progress import fmt_rate, say
from tools.bench.session import compact, random_prompt
from tools.bench.timing import summary


def ms_per_round(rep: dict) -> float | None:
    rounds = rep["rounds"] if rep["draft_tokens"] > 0 else rep["completion_tokens"] - 1
    return rep["decode_s"] / rounds * 1e3 if rounds > 0 and rep["decode_s"] > 0 else None


def acceptance(reps: list[dict]) -> list[float]:
    rounds = sum(r["rounds"] for r in reps)
    k = max((len(r["accepted_per_position"]) for r in reps), default=0)
    totals = [sum(r["accepted_per_position"][i] for r in reps if i < len(r["accepted_per_position"]))
              for i in range(k)]
    return [t / rounds for t in totals] if rounds else []


def decode_rep(bench, session, context: int, max_tokens: int, params: dict | None = None) -> dict:
    """One request of a fresh `context`-token prompt decoding `max_tokens` tokens: its compact stats."""
    sp = SamplingParams(**{"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, **(params or {})})
    stats = session.generate(random_prompt(context, session.vocab), sp,
                             timeout=max(120.0, 10 * (bench.estimate_prefill_s(context) + max_tokens * 0.1)))
    rep = compact(stats)
    if session.spec.model == bench.model:      # a rate of another shape would mispredict this one's
        bench.note_prefill_rate("engine-with-decode", context, rep["prefill_tok_s"])
    return rep


def point_from_reps(reps: list[dict], context: int, max_tokens: int, engine: dict, label: str) -> dict:
    rates = summary([r["decode_tok_s"] for r in reps])
    ms = [m for m in (ms_per_round(r) for r in reps) if m is not None]
    point = {"context": context, "max_tokens": max_tokens, "draft_tokens": reps[0]["draft_tokens"],
             "decode_tok_s_peak": rates["peak"], "decode_tok_s_median": rates["median"],
             "ms_per_round_best": min(ms) if ms else None, "ms_per_round_median": summary(ms)["median"],
             "acceptance_per_position": acceptance(reps), "repeats": reps, "engine": engine}
    acc = "/".join(f"{a:.2f}" for a in point["acceptance_per_position"]) or "-"
    say(label, f"ctx={context} k={point['draft_tokens']}: {point['ms_per_round_median'] or 0:.2f} ms/round median, "
               f"{fmt_rate(rates['median'])} median, acceptance {acc} ({len(reps)} x {max_tokens} tokens)")
    return point


def decode_point(bench, session, context: int, repeats: int, max_tokens: int, label: str,
                 params: dict | None = None) -> dict:
    """`repeats` requests of a fresh `context`-token prompt decoding `max_tokens` tokens."""
    reps = [decode_rep(bench, session, context, max_tokens, params) for _ in range(repeats)]
    return point_from_reps(reps, context, max_tokens, session.describe, label)


def speed_from_warmup(stats) -> float:
    """Seconds per generated token seen in one request (a prediction for sizing requests)."""
    rep = compact(stats)
    n = rep["completion_tokens"] - 1
    return rep["decode_s"] / n if n > 0 and rep["decode_s"] > 0 else 0.05


def seconds_per_token(session, context: int) -> float:
    """From the engine's first request when it decoded enough, else from a short request now."""
    stats = session.warm_stats
    if stats is None or stats.usage.completion_tokens < 16:
        stats = session.generate(random_prompt(context, session.vocab), SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0))
    return speed_from_warmup(stats)


def tokens_for(plan, s_per_token: float) -> int:
    return int(min(plan.max_tokens, max(plan.min_tokens, plan.target_decode_s / max(s_per_token, 1e-6))))


def run(bench, sec: dict) -> None:
    plan = bench.plan.decode
    points = sec.setdefault("points", [])
    pairs = sec.setdefault("round_cost_pairs", [])
    ref = bench.plan.reference["decode_context"]
    base_spec = bench.engine_spec(draft_tokens=0)
    variants = [(k, 0) for k in plan.ks if k > 0]
    if plan.draft_vocab and plan.draft_vocab < bench.cfg.vocab_size:
        variants += [(k, plan.draft_vocab) for k in plan.draft_vocab_ks]
    base = None
    if 0 in plan.ks:
        base = _sweep(bench, points, base_spec, 0, 0, plan.contexts.get(0, []))
    for k, dv in variants:
        contexts = plan.contexts.get(k, [])
        if dv:   # the reduced draft vocabulary is measured at the shortest context only
            contexts = contexts[:1] or [min(min(c) for c in plan.contexts.values() if c)]
        spec = bench.engine_spec(draft_tokens=k, draft_vocab=dv)
        paired = base is not None and ref in contexts and bench.pool.holds(base_spec)
        _sweep(bench, points, spec, k, dv, contexts, pair_with=(base_spec, base, pairs) if paired else None)
    sec["status"] = "ok"


def _sweep(bench, points: list, spec, k: int, dv: int, contexts: list[int], pair_with=None) -> float | None:
    """Every context of one engine; with `pair_with` (the k = 0 spec, its seconds per token, the pair
    list), the reference context is an interleaved comparison with the k = 0 engine. -> s per token."""
    plan = bench.plan.decode
    label = f"k={k}" + (f" draft_vocab={dv}" if dv else "")
    if not contexts:
        return None
    first = (0 if bench.pool.holds(spec) else bench.build_guess_s()) + bench.estimate_prefill_s(min(contexts))
    if not bench.budget.allows(first):
        for c in contexts:
            points.append({"context": c, "draft_tokens": k, "draft_vocab": dv, "skipped": bench.budget.skip_reason(first)})
        say("decode", f"{label}: skipped ({bench.budget.skip_reason(first)})")
        return None
    keep = (pair_with[0],) if pair_with else ()
    session, reused = bench.pool.get(spec, warm_prompt=min(contexts), warm_decode=32, keep=keep)
    if not reused:
        say("decode", f"engine {label}: {session.setup_text}")
    s_tok = seconds_per_token(session, min(contexts))
    ref = bench.plan.reference["decode_context"]
    for c in contexts:
        repeats = plan.repeats.get(c, 1)
        max_tokens = tokens_for(plan, pair_with[1] if pair_with and c == ref else s_tok)
        one = bench.estimate_prefill_s(c) + max_tokens * s_tok
        if pair_with and c == ref:
            base_spec, _, pairs = pair_with
            base_session = bench.pool.sessions[base_spec]
            pair = interleave.run({"k0": lambda: decode_rep(bench, base_session, c, max_tokens),
                                   "k": lambda: decode_rep(bench, session, c, max_tokens)},
                                  plan.pair_reps, bench.budget, 2 * one, k=k, draft_vocab=dv, context=c,
                                  max_tokens=max_tokens, tensor_parallel_size=spec.tensor_parallel_size)
            pairs.append(pair)
            point = point_from_reps(pair["reps"]["k"], c, max_tokens, session.describe, "decode")
        else:
            if not bench.budget.allows(one * repeats):
                repeats = 1
                if not bench.budget.allows(one):
                    points.append({"context": c, "draft_tokens": k, "draft_vocab": dv,
                                   "skipped": bench.budget.skip_reason(one)})
                    say("decode", f"{label} ctx={c}: skipped ({bench.budget.skip_reason(one)})")
                    continue
            point = decode_point(bench, session, c, repeats, max_tokens, "decode")
        point["draft_vocab"] = dv
        points.append(point)
        bench.save()
    return s_tok
