"""Where a decode step's time goes: kernel time by kind per step, against the step's wall time.

    python3 tools/dev/profile_decode.py [--model preset:qwen3-8b] [--context 512] [--draft-tokens 0,3] [--steps 20]
                                    [--tensor-parallel-size 2] [--batch 1,8] [--modes sync,async]

Builds the engine on cuda:0 (and cuda:1.. with TP) with random weights, warms it up (graphs
captured); then for each batch size starts that many requests at the given context and, for each
scheduling mode (`sync`: every round waits for the last one's tokens; `async`: the next round is
enqueued first, engine.worker.async_rounds), times 5 x `--steps` decode rounds without the profiler, then records
`--steps` with torch.profiler. Prints per-round milliseconds by kernel kind and device, the GPU idle per
round (wall time less kernel time on cuda:0) and the top kernels; writes every row to one $OUT/profile_*.json.
Modes need a build with async scheduling (`EngineCore.async_scheduling`); an older one runs `sync`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from engine import SamplingParams, envs
from engine.config import EngineConfig
from engine.core import EngineCore
from tools.bench.runinfo import ENGINE_SWITCHES

KINDS = (  # first match wins
    ("all-reduce+add+norm", ("ninfer_ar_add_norm",)),
    ("all-reduce", ("ninfer_ar_", "nccl")),
    ("attention", ("_attn_kernel", "_merge_kernel", "flash", "fmha")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "gemv", "cublas", "splitK")),
    ("rmsnorm", ("_rms_norm", "_gated_kernel")),
    ("linear-attention", ("_conv_qkv", "_recurrent_kernel", "fused_recurrent", "chunk_gated", "conv")),
    ("qk_norm_rope+kv", ("_qk_norm_rope", "_write_kv")),
    ("silu_mul", ("_silu_mul",)),
    ("sampling/argmax", ("argmax", "sort", "softmax", "scatter", "cumsum", "topk", "reduce_kernel")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k.lower() in low for k in keys):
            return kind
    return "other"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="preset:qwen3-8b")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--draft-tokens", default="0", help="k, or comma-separated values (one engine each)")
    ap.add_argument("--draft-vocab", type=int, default=0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--batch", default="1", help="comma-separated batch sizes")
    ap.add_argument("--modes", default="sync,async", help="comma-separated scheduling modes: sync, async")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the tool itself")
    ap.add_argument("--label", default="", help="added to the JSON file names (e.g. the commit)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    modes = args.modes.split(",")

    rows = []
    for k in [int(x) for x in str(args.draft_tokens).split(",")]:     # one engine per k, one after the other
        rows += profile_engine(argparse.Namespace(**{**vars(args), "draft_tokens": k}), batches, modes)
    print(f"\n{'batch':>5} {'k':>2} {'mode':>6} {'ms/round':>9} {'busy ms':>8} {'idle ms':>8} {'tok/round':>9}")
    for r in rows:
        print(f"{r['batch']:5d} {r['args']['draft_tokens']:2d} {r['mode']:>6} {r['ms_per_round']:9.3f} "
              f"{r['busy_ms']:8.3f} {r['idle_ms']:8.3f} {r['tokens_per_round']:9.2f}")
    out = os.environ.get("OUT")
    if out:
        name = (f"profile_{args.model.split(':')[-1]}_tp{args.tensor_parallel_size}_ctx{args.context}"
                f"_k{args.draft_tokens.replace(',', '-')}{'_' + args.label if args.label else ''}.json")
        with open(os.path.join(out, name), "w") as f:
            json.dump(rows, f, indent=1)


def profile_engine(args, batches: list[int], modes: list[str]) -> list[dict]:
    core = EngineCore(EngineConfig(model=args.model, device=args.device, draft_tokens=args.draft_tokens,
                                   draft_vocab=args.draft_vocab, max_batch=max(4, *batches),
                                   kv_capacity=max(batches) * (args.context + 4096),
                                   max_model_len=args.context + 2048, enforce_eager=args.eager,
                                   tensor_parallel_size=args.tensor_parallel_size))
    core.warmup()
    can_overlap = getattr(core, "async_scheduling", False)
    rows = []
    for batch in batches:
        for mode in modes:
            if mode == "async" and not can_overlap:
                print(f"batch {batch}: no async scheduling in this build/config "
                      f"({getattr(core, 'sync_reason', 'no engine.worker.async_rounds')}); skipped")
                continue
            rows.append(profile_one(core, args, batch, mode))
    core.shutdown()
    return rows


def profile_one(core: EngineCore, args, batch: int, mode: str) -> dict:
    if hasattr(core, "async_scheduling"):
        while core.has_work:                             # nothing in flight while the mode changes
            core.step()
        core.async_scheduling = mode == "async"
    rng = random.Random(batch)
    max_tokens = 8 * args.steps * (args.draft_tokens + 1) + 64
    vocab = core.model_config.vocab_size
    reqs = [core.add_request([rng.randrange(min(1000, vocab // 2), min(100000, vocab)) for _ in range(args.context)],
                             SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)) for _ in range(batch)]
    while core.scheduler.lane or core.scheduler.waiting:
        core.step()
    for _ in range(5):
        core.step()
    _sync()
    tokens0 = sum(r.num_output_tokens for r in reqs)
    plain_steps = 5 * args.steps                        # the unprofiled timing: longer, so one stall weighs less
    start = time.perf_counter()
    for _ in range(plain_steps):
        core.step()
    _sync()
    plain_ms = (time.perf_counter() - start) * 1e3 / plain_steps
    tokens_per_round = (sum(r.num_output_tokens for r in reqs) - tokens0) / plain_steps / batch

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            core.step()
        _sync()
        wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
    for req in reqs:
        core.abort(req.request_id)

    # kernels of rank 0's device (every rank runs the same graph on its own shard)
    per_kind: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    busy_by_device: dict[int, float] = defaultdict(float)
    kernels_by_device: dict[int, int] = defaultdict(int)
    reduce_us: dict[int, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            us = ev.device_time_total
            busy_by_device[ev.device_index] += us / 1e3 / args.steps
            if not ev.name.startswith("Memcpy") and not ev.name.startswith("Memset"):
                kernels_by_device[ev.device_index] += 1
            if kind_of(ev.name).startswith("all-reduce"):
                reduce_us[ev.device_index].append(us)
            if ev.device_index != 0:
                continue
            per_kind[kind_of(ev.name)] += us
            per_kernel[ev.name][0] += us
            per_kernel[ev.name][1] += 1
    busy_ms = sum(per_kind.values()) / 1e3 / args.steps
    print(f"model {args.model} TP={args.tensor_parallel_size} context {args.context} batch {batch} "
          f"k={args.draft_tokens} draft_vocab={args.draft_vocab} {'eager' if args.eager else 'graphs'} {mode}: "
          f"{plain_ms:.3f} ms per round ({wall_ms:.3f} under the profiler), cuda:0 kernels busy {busy_ms:.3f} ms "
          f"({busy_ms / plain_ms:.0%}), idle {plain_ms - busy_ms:.3f} ms; {tokens_per_round:.2f} tokens per "
          f"request-round; busy by device: "
          + ", ".join(f"cuda:{d} {ms:.3f}" for d, ms in sorted(busy_by_device.items())))
    switches = {k: envs.SWITCHES[k].raw() for k in ENGINE_SWITCHES}      # unset: the engine's default
    kernels_per_round = {d: n / args.steps for d, n in sorted(kernels_by_device.items())}
    print("  kernels per round: " + ", ".join(f"cuda:{d} {n:.0f}" for d, n in kernels_per_round.items())
          + "  (switches set: " + (", ".join(f"{k}={v}" for k, v in switches.items() if v is not None) or "none")
          + ")")
    # a rank that starts late makes the others wait in one collective; a rank that is slower throughout
    # spreads the wait over all of them
    for d, durations in sorted(reduce_us.items()):
        durations.sort()
        n = len(durations)
        print(f"  all-reduce cuda:{d}: {n // args.steps} per round, median {durations[n // 2]:.1f} us, "
              f"longest per round {sum(durations[-args.steps:]) / args.steps:.1f} us, "
              f"total {sum(durations) / 1e3 / args.steps:.3f} ms/round")
    for kind, us in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:18s} {us / 1e3 / args.steps:8.3f} ms/round")
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:15]
    for name, (us, n) in top:
        print(f"  {us / 1e3 / args.steps:8.3f} ms/round  {n // args.steps:4d}x  {name[:90]}")
    row = {"args": vars(args), "batch": batch, "mode": mode, "ms_per_round": plain_ms, "wall_ms_profiled": wall_ms,
           "busy_ms": busy_ms, "idle_ms": plain_ms - busy_ms, "tokens_per_round": tokens_per_round,
           "busy_ms_by_device": busy_by_device,
           "all_reduce_us_by_device": {d: sorted(v) for d, v in reduce_us.items()}, "kernels_per_round_by_device": kernels_per_round,
           "fused_norm": envs.TP_FUSED_NORM.read(),
           "pdl": envs.PDL.read(),
           "switches": switches,
           "per_kind_ms": {k: v / 1e3 / args.steps for k, v in per_kind.items()},
           "top": [(n, us / 1e3 / args.steps, c // args.steps) for n, (us, c) in top]}
    return row


if __name__ == "__main__":
    main()
