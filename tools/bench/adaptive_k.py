"""Adaptive draft length against every fixed k, replayed from the small trained model's acceptance.

`python -m tools.bench.adaptive_k [--model PATH] [--out DIR]` runs the trained tiny model on the
acceptance workloads (`tools.bench.workloads`, plus random token ids: a workload where drafts fail)
at k = k_max, greedy and at T = 0.7, and records every round's accepted length L (0 .. k_max) per
request. It then replays those rounds through a batch of B requests (B consecutive recorded rounds
make one batch round) for each fixed k -- a request drafting k keeps min(L, k) drafts, since
drafts 1..k are the same tokens whatever the k -- and for `engine.sched.draft_policy.DraftPolicy`, which
sees only what the engine would (its own choices' outcomes). Throughput = tokens / the round cost
model (`RoundCost`, seeded from the qwen3-8b H200 sweep). The replay is an approximation: with
another k, the rounds would start at other positions.

Prints a Markdown table (adaptive over the best fixed k, per workload, temperature and batch) and
writes it with the raw traces' summary to DIR (table.md, results.json).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.sched.draft_policy import DraftPolicy, RoundCost
from engine.sampling_params import SamplingParams
from tools.bench.workloads import WORKLOADS

K_MAX = 4
BATCHES = (1, 8, 32, 64)
SEED = 20261130


def random_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    import torch
    gen = torch.Generator().manual_seed(SEED)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def record_traces(model: str, temperatures=(0.0, 0.7), max_tokens: int = 96) -> dict[tuple[str, float], list[int]]:
    """(workload, T) -> accepted length of every round of every prompt, at k = K_MAX."""
    from engine import LLM
    llm = LLM(model, device="cpu", dtype="float32", kv_capacity=16384, draft_tokens=K_MAX, prefix_reuse=False)
    core = llm.engine
    workloads = {**WORKLOADS, "random_ids": random_prompts(4, 48, core.model_config.vocab_size)}
    traces = {}
    for t in temperatures:
        for name, prompts in workloads.items():
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=t, seed=SEED)
            reqs = {core.add_request(p, params).request_id for p in prompts}
            seen: set[str] = set()
            lengths: list[int] = []
            while core.has_work:
                for out in core.step():
                    if out.request_id not in reqs:
                        continue
                    if out.request_id in seen and not out.finished:     # a whole round (not the prefill's, not cut)
                        lengths.append(len(out.new_token_ids) - 1)
                    seen.add(out.request_id)
            traces[(name, t)] = lengths
    llm.engine.shutdown()
    return traces


def replay(trace: list[int], batch: int, rounds: int, cost: RoundCost, choose=None) -> tuple[float, dict[int, int]]:
    """Tokens per ms of `rounds` batch rounds over the trace (cycled); `choose` is a DraftPolicy or
    a fixed k. -> (rate, {k: rounds run at k})."""
    tokens = ms = 0.0
    used: dict[int, int] = {}
    pos = 0
    for _ in range(rounds):
        k = choose.choose(batch) if isinstance(choose, DraftPolicy) else choose
        used[k] = used.get(k, 0) + 1
        for _ in range(batch):
            kept = min(trace[pos % len(trace)], k)
            pos += 1
            tokens += 1 + kept
            if isinstance(choose, DraftPolicy):
                choose.observe(k, kept)
        ms += cost(k, batch)
    return tokens / ms, used


def compare(traces: dict, batches=BATCHES, rounds: int = 600, cost: RoundCost | None = None) -> list[dict]:
    cost = cost or RoundCost()
    rows = []
    for (name, t), trace in traces.items():
        for b in batches:
            fixed = {k: replay(trace, b, rounds, cost, k)[0] for k in range(K_MAX + 1)}
            best = max(fixed, key=fixed.get)
            rate, used = replay(trace, b, rounds, cost, DraftPolicy(K_MAX, cost))
            acc = [sum(1 for L in trace if L > i) / max(1, sum(1 for L in trace if L >= i)) for i in range(K_MAX)]
            rows.append({"workload": name, "temperature": t, "batch": b, "rounds_recorded": len(trace),
                         "acceptance_per_position": acc, "fixed_tok_per_ms": fixed, "best_fixed_k": best,
                         "adaptive_tok_per_ms": rate, "adaptive_over_best": rate / fixed[best],
                         "adaptive_k_rounds": dict(sorted(used.items()))})
    return rows


def table(rows: list[dict]) -> str:
    head = ("| workload | T | batch | a_1..a_4 (conditional) | best fixed k | its tok/ms | adaptive tok/ms | "
            "adaptive / best | rounds at k (adaptive) |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['temperature']:g} | {r['batch']} | "
            f"{' '.join(f'{a:.2f}' for a in r['acceptance_per_position'])} | {r['best_fixed_k']} | "
            f"{r['fixed_tok_per_ms'][r['best_fixed_k']]:.3f} | {r['adaptive_tok_per_ms']:.3f} | "
            f"**{r['adaptive_over_best']:.3f}** | "
            f"{', '.join(f'{k}: {n}' for k, n in r['adaptive_k_rounds'].items())} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.adaptive_k", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="../shared/models/tiny-qwen3-mtp")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = compare(record_traces(args.model))
    text = table(rows)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.md").write_text(text + "\n")
        (out / "results.json").write_text(json.dumps({"k_max": K_MAX, "cost_model": RoundCost().__dict__,
                                                      "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
