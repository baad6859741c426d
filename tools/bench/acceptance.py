"""Acceptance per draft position on the small trained model, per workload, at T=0 and T=0.7 (seeded).

Acceptance is a property of trained weights, so it is measured on `models/tiny-qwen3-mtp`; the cost
of a round is a property of the shape, measured by the decode sweep on the large shape. Together
they give the decode rate a workload would see on the large shape:

    tokens per round      = 1 + sum_i acceptance_i       (acceptance_i = accepted_per_position[i] / rounds)
    implied decode tok/s  = tokens per round / ms_per_round(k)

(the seed's rule: a decode figure is meaningless without its acceptance rate). Each workload's
figure pools the rounds of its prompts; all prompts of one (k, T) run together in one batch.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.sampling_params import SamplingParams
from tools.bench.decode import acceptance as pooled_acceptance
from tools.bench.progress import say
from tools.bench.session import EngineSpec, compact
from tools.bench.workloads import WORKLOADS

SEARCH = (".models/tiny-qwen3-mtp", "../shared/models/tiny-qwen3-mtp", "/work/shared/models/tiny-qwen3-mtp")
SEED = 20261130


def find_model(explicit: str | None, repo: Path) -> Path | None:
    candidates = [Path(explicit)] if explicit else [repo / p for p in SEARCH]
    for c in candidates:
        if (c / "config.json").exists():
            return c.resolve()
    return None


def temp_key(t: float) -> str:
    return f"T{t:g}"


def run(bench, sec: dict) -> None:
    plan = bench.plan.acceptance
    path = bench.acceptance_model
    if path is None:
        sec["status"] = "skipped"
        sec["reason"] = "the small trained model was not found (--acceptance-model PATH; looked in " + ", ".join(SEARCH) + ")"
        say("acceptance", sec["reason"])
        return
    sec["model"] = str(path)
    sec["implied_context"] = plan.implied_context
    ref = path / "training_eval.json"
    if ref.exists():
        try:
            sec["training_reference"] = {w: v["accept_per_position"] for w, v in
                                         json.loads(ref.read_text())["acceptance_k3_greedy"].items()}
        except (KeyError, ValueError):
            pass
    results = sec.setdefault("results", [])
    prompts = [(w, p) for w, ps in WORKLOADS.items() for p in ps[:plan.prompts_per_workload]]
    for k in plan.ks:
        if not bench.budget.allows(2.0):
            say("acceptance", f"k={k}: skipped ({bench.budget.skip_reason(2.0)})")
            results.append({"k": k, "skipped": bench.budget.skip_reason(2.0)})
            continue
        spec = EngineSpec(model=str(path), device=bench.device, prefill_chunk=512, draft_tokens=k,
                          kv_capacity=len(prompts) * (512 + plan.max_tokens + k + 16))
        session, _ = bench.pool.get(spec, warm_prompt=256, warm_decode=16)
        for t in plan.temperatures:
            params = [SamplingParams(max_tokens=plan.max_tokens, temperature=t, seed=SEED + i, ignore_eos=True)
                      for i in range(len(prompts))]
            stats = [compact(s) for s in session.generate_many([p for _, p in prompts], params, timeout=600)]
            for workload in WORKLOADS:
                reps = [s for (w, _), s in zip(prompts, stats) if w == workload]
                acc = pooled_acceptance(reps)
                entry = {"workload": workload, "k": k, "temperature": t, "prompts": len(reps),
                         "rounds": sum(r["rounds"] for r in reps),
                         "accepted_per_position_total": [sum(r["accepted_per_position"][i] for r in reps)
                                                         for i in range(k)],
                         "completion_tokens": sum(r["completion_tokens"] for r in reps),
                         "acceptance_per_position": acc, "tokens_per_round": 1 + sum(acc),
                         "engine_decode_tok_s_small_model": sum(r["decode_tok_s"] for r in reps) / len(reps)}
                results.append(entry)
                say("acceptance", f"{workload:<11} k={k} T={t:g}: " + " / ".join(f"{a:.2f}" for a in acc)
                                  + f"  -> {entry['tokens_per_round']:.2f} tokens/round")
            bench.save()
    sec["engine"] = bench.pool.session.describe if bench.pool.session else None
    bench.pool.close()
    sec["status"] = "ok"
