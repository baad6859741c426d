"""Where a long prefill's time goes, per chunk size: kernel time by kind against the request's wall time.

    python3 tools/dev/profile_prefill.py [--model preset:qwen3-8b] [--chunks 1024,2048,4096] [--prompts 4096,16384]

One engine per chunk (the chunk is an engine setting) with random weights on cuda:0. Each prompt is
fresh random tokens with max_tokens=1, so the request's life is its prefill. Per (chunk, P): the
prefill's wall time and tokens/s without the profiler (median of --repeats), then one run under
torch.profiler: GPU busy time by kernel kind (the kinds of tools/dev/profile_decode.py), idle = wall -
busy, and the top kernels with their count and mean duration. This is the figure the bench's prefill
section reports (EngineCore's own step loop here; the bench goes through EngineSession). Writes
$OUT/profile_prefill.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from engine import SamplingParams
from engine.config import EngineConfig
from engine.core import EngineCore
from tools.dev.profile_decode import kind_of


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prefill_once(core: EngineCore, P: int, seed: int) -> float:
    """Seconds from add_request to the request's one token (max_tokens=1: prefill, then a sample)."""
    rng = random.Random(seed)
    vocab = core.model_config.vocab_size
    prompt = [rng.randrange(min(1000, vocab // 2), vocab) for _ in range(P)]
    _sync()
    start = time.perf_counter()
    req = core.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0))
    while core.has_work:
        core.step()
    _sync()
    if req.num_output_tokens != 1:
        raise RuntimeError(f"prefill of {P} tokens produced {req.num_output_tokens} tokens")
    return time.perf_counter() - start


def profile_point(core: EngineCore, chunk: int, P: int, repeats: int) -> dict:
    walls = [prefill_once(core, P, seed=1000 * P + i) for i in range(repeats)]
    wall = statistics.median(walls)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prof_wall = prefill_once(core, P, seed=7)
    per_kind: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0 and ev.device_index == 0:
            per_kind[kind_of(ev.name)] += ev.device_time_total / 1e3
            per_kernel[ev.name][0] += ev.device_time_total / 1e3
            per_kernel[ev.name][1] += 1
    busy = sum(per_kind.values())
    print(f"chunk {chunk} P={P}: {wall * 1e3:.1f} ms ({P / wall:,.0f} tok/s, median of {repeats}); under the "
          f"profiler {prof_wall * 1e3:.1f} ms, GPU busy {busy:.1f} ms, idle {prof_wall * 1e3 - busy:.1f} ms; "
          f"{-(-P // chunk)} chunks")
    for kind, ms in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:18s} {ms:9.2f} ms")
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:10]
    for name, (ms, n) in top:
        print(f"  {ms:9.2f} ms {n:5d}x {1e3 * ms / n:8.1f} us  {name[:80]}")
    return {"chunk": chunk, "P": P, "wall_ms": wall * 1e3, "walls_ms": [w * 1e3 for w in walls],
            "tok_s": P / wall, "profiled_wall_ms": prof_wall * 1e3, "busy_ms": busy,
            "per_kind_ms": dict(per_kind), "top": [(n, ms, c) for n, (ms, c) in top]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="preset:qwen3-8b")
    ap.add_argument("--chunks", default="1024,2048,4096")
    ap.add_argument("--prompts", default="4096,16384")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the tool itself")
    args = ap.parse_args()
    prompts = [int(p) for p in args.prompts.split(",")]
    rows = []
    for chunk in [int(c) for c in args.chunks.split(",")]:
        core = EngineCore(EngineConfig(model=args.model, device=args.device, draft_tokens=0, max_batch=4,
                                       prefill_chunk=chunk, kv_capacity=max(prompts) + 4096,
                                       max_model_len=max(prompts) + 1024))
        core.warmup()
        prefill_once(core, min(2 * chunk, max(prompts)), seed=1)     # compiles the prefill shapes
        for P in prompts:
            rows.append(profile_point(core, chunk, P, args.repeats))
        core.shutdown()
        del core
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    print(f"\n{'chunk':>6} {'P':>6} {'ms':>8} {'tok/s':>8} " + " ".join(f"{k:>10}" for k in ("gemm", "attention", "idle")))
    for r in rows:
        k = r["per_kind_ms"]
        print(f"{r['chunk']:6d} {r['P']:6d} {r['wall_ms']:8.1f} {r['tok_s']:8,.0f} {k.get('gemm', 0):10.1f} "
              f"{k.get('attention', 0):10.1f} {r['profiled_wall_ms'] - r['busy_ms']:10.1f}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "profile_prefill.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
