"""Structured output: the host time to fill a JSON-schema mask per decode step, against the step.

Per batch b (1 and 32): b matchers of one JSON schema (the engine's grammar backend,
engine/structured), each at its own position of its own schema-valid token sequence (sampled under the
mask from random logits, as the unit tests do); a step's fill is `RoundMasks.begin` over the b of
them -- the one host call the engine makes before it enqueues a constrained step (row 0 of each
request; drafts add one fill per draft, inside the round). The step is an unconstrained decode round
of this run's shape at batch b (`ms_per_round` from the request stats of b streams decoding together).

    share_b = fill_median_ms(b) / ms_per_round(b)

is the headline `structured_decode_overhead_b{1,32}` on a GPU (BENCH targets 0.05 and 0.10). The fill
is serial with the step under synchronous scheduling; with async scheduling the host fills while the
device runs the round before, so the share bounds the overhead. On the CPU the figures are a dry run
of the code path (a CPU step is not a GPU step), and the headline stays empty with that reason.

The vocabulary is the tokenizer of the small trained model (or --structured-tokenizer, e.g. a real
Qwen3 tokenizer.json), padded to the shape's logits width: fill time grows with the tokenizer's size.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from engine.sampling_params import SamplingParams
from tools.bench.progress import say
from tools.bench.session import compact, random_prompt

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,8}\\.(com|org)$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}


def _vocabulary(tokenizer_dir: Path, width: int):
    from engine.structured.vocabulary import GrammarVocabulary
    text = (tokenizer_dir / "tokenizer.json").read_text()
    config = tokenizer_dir / "config.json"
    eos = json.loads(config.read_text()).get("eos_token_id", 0) if config.exists() else 0
    size = max(json.loads(text)["model"]["vocab"].values()) + 1
    return GrammarVocabulary.from_tokenizer_json(text, max(width, size + 64), eos if isinstance(eos, list) else [eos])


def _walks(grammar, vocab, n: int, max_tokens: int) -> list[list[int]]:
    """n schema-valid token sequences: argmax of random logits under the mask, biased to stop tokens."""
    from engine.structured.bitmask import apply_token_mask
    from engine.structured.matcher import GrammarState
    out = []
    for seed in range(n):
        gen = torch.Generator().manual_seed(seed)
        state = GrammarState(grammar, vocab.stop_token_ids, vocab.words)
        row = torch.empty(1, vocab.words, dtype=torch.int32)
        tokens: list[int] = []
        for _ in range(max_tokens):
            state.fill(row[0])
            logits = torch.randn(1, vocab.vocab_size, generator=gen)
            logits[0, list(vocab.stop_token_ids)] += 4.0
            t = int(apply_token_mask(logits, row).argmax())
            state.accept(t)
            tokens.append(t)
            if state.terminated:
                break
        out.append(tokens)
    return out


def fill_times(grammar, vocab, walks: list[list[int]], batch: int, max_batch: int) -> list[float]:
    """Seconds of RoundMasks.begin over `batch` matchers, one per step along their walks."""
    from engine.structured.matcher import GrammarState
    from engine.structured.round_masks import RoundMasks
    masks = RoundMasks(max_batch, 0, vocab.words)
    states = [GrammarState(grammar, vocab.stop_token_ids, vocab.words) for _ in range(batch)]
    seqs = [walks[i % len(walks)] for i in range(batch)]
    steps = min(len(s) for s in seqs) - 1
    times = []
    for t in range(steps):
        start = time.perf_counter()
        masks.begin(states)
        times.append(time.perf_counter() - start)
        masks.end()
        for s, seq in zip(states, seqs):
            s.accept(seq[t])
    return times


def run(bench, sec: dict) -> None:
    plan = bench.plan.structured
    source = Path(plan.tokenizer) if plan.tokenizer else bench.acceptance_model
    if source is None or not (source / "tokenizer.json").exists():
        sec["status"] = "skipped"
        sec["reason"] = "no tokenizer.json: pass --structured-tokenizer DIR or --acceptance-model PATH"
        say("structured", sec["reason"])
        return
    from engine.structured.compiler import GrammarCompiler
    from engine.structured.spec import GrammarSpec
    vocab = _vocabulary(source, bench.cfg.vocab_size)
    compiler = GrammarCompiler(vocab)
    t0 = time.perf_counter()
    grammar = compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA))).result(timeout=120)
    walks = _walks(grammar, vocab, plan.walks, plan.walk_tokens)
    sec["setup"] = {"tokenizer": str(source), "tokenizer_size": vocab.tokenizer_size, "logits_width": vocab.vocab_size,
                    "schema": SCHEMA, "compile_ms": round((time.perf_counter() - t0) * 1e3, 2),
                    "walk_tokens": [len(w) for w in walks]}
    compiler.shutdown()
    room = max(plan.batches) * (plan.context + plan.decode_tokens + 32)
    session, reused = bench.pool.get(bench.engine_spec(draft_tokens=0, max_batch=max(plan.batches),
                                                       kv_capacity=max(bench.plan.kv_capacity, room)),
                                     warm_prompt=plan.context, warm_decode=16)
    say("structured", "engine " + ("reused" if reused else session.setup_text))
    points = sec.setdefault("points", [])
    for b in plan.batches:
        fills = fill_times(grammar, vocab, walks, b, max(plan.batches))
        stats = session.generate_many([random_prompt(plan.context, session.vocab) for _ in range(b)],
                                      [SamplingParams(max_tokens=plan.decode_tokens, ignore_eos=True, temperature=0.0)] * b)
        reps = [compact(s) for s in stats]
        step_ms = statistics.median(r["decode_s"] / (r["completion_tokens"] - 1) * 1e3 for r in reps)
        fill_ms = statistics.median(fills) * 1e3
        point = {"batch": b, "fill_ms_median": fill_ms, "fill_ms_p90": sorted(fills)[int(0.9 * (len(fills) - 1))] * 1e3,
                 "fill_us_per_request": fill_ms * 1e3 / b, "steps": len(fills), "step_ms": step_ms,
                 "share": fill_ms / step_ms, "device": bench.kind}
        points.append(point)
        say("structured", f"batch {b}: fill {fill_ms:.3f} ms (p90 {point['fill_ms_p90']:.3f}) of a {step_ms:.2f} ms "
                          f"step: {point['share']:.3f}")
