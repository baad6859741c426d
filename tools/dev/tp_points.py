"""TP2 against TP1 on the points issue 15 names, in one short run (fits a 170-second device slot):

    python3 tools/dev/tp_points.py [--model preset:qwen3-8b] [--variants tp1,tp2,tp2-unfused] [--tokens 128]

For each variant one engine (the bench's build: `tools.bench.session.EngineSession`, graphs captured,
one warm-up request), then: decode batch 1 at a 512-token context (k = 0), 8 streams of 512-token
prompts decoding together (`tools.bench.concurrency.streams_point`: parked after prefill, resumed
in one command; aggregate = the sum of the streams' decode rates), and the prefill of a fresh
512-token prompt alone (best of 3), and kernels per decode round counted by the profiler.
`tp2` is the engine's default (fused all-reduce + add + RMSNorm), `tp2-split8` adds the K-split
projections, `tp2-unfused` has neither (engine.layers.reduce_add_norm.FUSED, K_SPLITS): the before/after in
the same run. Prints a
table and writes $OUT/tp_points.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

import engine.layers.reduce_add_norm as tp_norm
from engine.sampling_params import SamplingParams
from tools.bench.concurrency import streams_point
from tools.bench.session import EngineSession, EngineSpec, compact, free_memory, random_prompt

CONTEXT = 512


def kernels_per_round(session, tokens: int = 24) -> dict:
    """Kernels per decode round on each device (batch 1, k = 0), counted by the profiler over one
    request's decode after its prefill (parked, then resumed under the profiler)."""
    stream = session.submit(random_prompt(CONTEXT, session.vocab), SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0),
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


def measure(model: str, tp: int, fused: bool, tokens: int, device: str = "cuda", k_splits: int = 8,
            count_kernels: bool = True) -> dict:
    tp_norm.FUSED = fused                        # read at every call, so also while graphs are captured
    tp_norm.K_SPLITS = k_splits                  # read when the layers are built
    t0 = time.perf_counter()
    spec = EngineSpec(model=model, device=device, prefill_chunk=4096, tensor_parallel_size=tp,
                      kv_capacity=16 * 1024, max_model_len=4096, max_batch=8)
    session = EngineSession(spec)
    try:
        session.warm_up(CONTEXT, 16)
        row = {"tp": tp, "fused": fused, "k_splits": k_splits, "setup_s": time.perf_counter() - t0}
        b1 = streams_point(session, 1, CONTEXT, tokens, timeout=120)
        row["decode_b1_tok_s"] = b1["aggregate_tok_s"]
        row["decode_b1_ms"] = 1e3 / b1["aggregate_tok_s"]
        s8 = streams_point(session, 8, CONTEXT, tokens, timeout=120)
        row["agg_8_streams_tok_s"] = s8["aggregate_tok_s"]
        row["agg_8_streams_wall_tok_s"] = s8["wall_aggregate_tok_s"]
        pre = [compact(session.generate(random_prompt(CONTEXT, session.vocab), SamplingParams(max_tokens=1, temperature=0.0)))
               for _ in range(3)]
        row["prefill_512_tok_s"] = max(p["prefill_tok_s"] for p in pre)
        row["ttft_512_ms"] = min(p["ttft_s"] for p in pre) * 1e3
        if count_kernels and device == "cuda":
            try:
                row["kernels_per_round"] = kernels_per_round(session)
            except Exception as e:  # noqa: BLE001 - the timings above stand without the count
                row["kernels_per_round_error"] = repr(e)[:300]
        row["engine"] = session.describe
        return row
    finally:
        session.close()
        free_memory()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="preset:qwen3-8b")
    ap.add_argument("--variants", default="tp1,tp2-unfused,tp2,tp2-split8",
                    help="tp1; tp2 (the engine's default: fused all-reduce + add + norm); tp2-split8 (also "
                         "the K-split projections); tp2-unfused (neither)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the code (in-process ranks)")
    args = ap.parse_args()
    rows, out = [], os.environ.get("OUT")
    for v in args.variants.split(","):
        tp = 2 if v.startswith("tp2") else 1
        if args.device == "cuda" and tp > torch.cuda.device_count():
            continue
        splits = 8 if v.endswith("split8") else 1
        try:
            rows.append({"variant": v, **measure(args.model, tp, not v.endswith("unfused"), args.tokens, args.device,
                                                 k_splits=splits)})
        except Exception as e:  # noqa: BLE001 - the other variants still run
            print(f"{v:12s} FAILED: {e!r}"[:400], flush=True)
            continue
        r = rows[-1]
        kern = " ".join(f"{d} {n:.0f}" for d, n in r.get("kernels_per_round", {}).items())
        print(f"{v:12s} setup {r['setup_s']:5.1f} s | decode b1 {r['decode_b1_tok_s']:7.1f} tok/s "
              f"({r['decode_b1_ms']:.3f} ms) | 8 streams {r['agg_8_streams_tok_s']:8.1f} tok/s | "
              f"prefill 512 {r['prefill_512_tok_s']:8.0f} tok/s (TTFT {r['ttft_512_ms']:.1f} ms) | "
              f"kernels/round {kern}", flush=True)
        if out:
            with open(os.path.join(out, "tp_points.json"), "w") as f:
                json.dump({"model": args.model, "context": CONTEXT, "rows": rows}, f, indent=1)
    base = next((r for r in rows if r["variant"] == "tp1"), None)
    tp2 = next((r for r in rows if r["variant"] == "tp2"), None)
    if base and tp2 and out:                     # headline keys (docs/performance.md), from this run's points
        keys = {"tp2_over_tp1_decode_b1": tp2["decode_b1_tok_s"] / base["decode_b1_tok_s"],
                "tp2_over_tp1_agg_8": tp2["agg_8_streams_tok_s"] / base["agg_8_streams_tok_s"],
                "tp2_over_tp1_prefill_512": tp2["prefill_512_tok_s"] / base["prefill_512_tok_s"]}
        with open(os.path.join(out, "tp_points.json"), "w") as f:
            json.dump({"model": args.model, "context": CONTEXT, "headline": keys, "rows": rows}, f, indent=1)
    if base:
        print(f"\n{'variant':12s} {'b1 / TP1':>9s} {'8 str / TP1':>12s} {'P512 / TP1':>11s}")
        for r in rows:
            print(f"{r['variant']:12s} {r['decode_b1_tok_s'] / base['decode_b1_tok_s']:9.2f} "
                  f"{r['agg_8_streams_tok_s'] / base['agg_8_streams_tok_s']:12.2f} "
                  f"{r['prefill_512_tok_s'] / base['prefill_512_tok_s']:11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
