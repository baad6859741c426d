"""Where a decode step's time goes: kernel time by kind per step, against the step's wall time.

    python3 tools/profile_decode.py [--model preset:qwen3-8b] [--context 512] [--draft-tokens 0] [--steps 20]
                                    [--tensor-parallel-size 2]

Builds the engine on cuda:0 (and cuda:1.. with TP) with random weights, warms it up (graphs
captured), starts one request at the given context, times `--steps` decode rounds without the
profiler, then records as many with torch.profiler. Prints per-round milliseconds by kernel kind
and device, the busy fraction, and the top kernels; writes $OUT/profile_*.json.
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

from engine import SamplingParams
from engine.config import EngineConfig
from engine.core import EngineCore

KINDS = (  # first match wins
    ("all-reduce+add+norm", ("ninfer_ar_add_norm",)),
    ("all-reduce", ("ninfer_ar_", "nccl")),
    ("attention", ("_attn_kernel", "_merge_kernel", "flash", "fmha")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "gemv", "cublas", "splitK")),
    ("rmsnorm", ("_rms_norm", "_zero_centred", "_gated_kernel")),
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="preset:qwen3-8b")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--draft-tokens", type=int, default=0)
    ap.add_argument("--draft-vocab", type=int, default=0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    args = ap.parse_args()

    core = EngineCore(EngineConfig(model=args.model, device="cuda", draft_tokens=args.draft_tokens,
                                   draft_vocab=args.draft_vocab, max_batch=4, kv_capacity=args.context + 4096,
                                   max_model_len=args.context + 2048, enforce_eager=args.eager,
                                   tensor_parallel_size=args.tensor_parallel_size))
    core.warmup()
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 100000) for _ in range(args.context)]
    core.add_request(prompt, SamplingParams(max_tokens=args.steps * (args.draft_tokens + 1) + 64, ignore_eos=True))
    while core.scheduler.lane or core.scheduler.waiting:
        core.step()
    for _ in range(5):
        core.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        core.step()
    torch.cuda.synchronize()
    plain_ms = (time.perf_counter() - start) * 1e3 / args.steps

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            core.step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / args.steps

    # kernels of rank 0's device (every rank runs the same graph on its own shard)
    per_kind: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    busy_by_device: dict[int, float] = defaultdict(float)
    kernels_by_device: dict[int, int] = defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            us = ev.device_time_total
            busy_by_device[ev.device_index] += us / 1e3 / args.steps
            if not ev.name.startswith("Memcpy") and not ev.name.startswith("Memset"):
                kernels_by_device[ev.device_index] += 1
            if ev.device_index != 0:
                continue
            per_kind[kind_of(ev.name)] += us
            per_kernel[ev.name][0] += us
            per_kernel[ev.name][1] += 1
    busy_ms = sum(per_kind.values()) / 1e3 / args.steps
    print(f"model {args.model} TP={args.tensor_parallel_size} context {args.context} k={args.draft_tokens} "
          f"draft_vocab={args.draft_vocab} {'eager' if args.eager else 'graphs'}: {plain_ms:.3f} ms per round "
          f"({wall_ms:.3f} under the profiler), cuda:0 kernels busy {busy_ms:.3f} ms ({busy_ms / plain_ms:.0%}); "
          f"busy by device: " + ", ".join(f"cuda:{d} {ms:.3f}" for d, ms in sorted(busy_by_device.items())))
    kernels_per_round = {d: n / args.steps for d, n in sorted(kernels_by_device.items())}
    print("  kernels per round: " + ", ".join(f"cuda:{d} {n:.0f}" for d, n in kernels_per_round.items())
          + f"  (NINFER_TP_FUSED_NORM={os.environ.get('NINFER_TP_FUSED_NORM', '1')})")
    for kind, us in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:18s} {us / 1e3 / args.steps:8.3f} ms/round")
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:15]
    for name, (us, n) in top:
        print(f"  {us / 1e3 / args.steps:8.3f} ms/round  {n // args.steps:4d}x  {name[:90]}")
    out = os.environ.get("OUT")
    if out:
        name = (f"profile_{args.model.split(':')[-1]}_tp{args.tensor_parallel_size}_ctx{args.context}"
                f"_k{args.draft_tokens}{'' if os.environ.get('NINFER_TP_FUSED_NORM', '1') != '0' else '_unfused'}.json")
        with open(os.path.join(out, name), "w") as f:
            json.dump({"args": vars(args), "ms_per_round": plain_ms, "wall_ms_profiled": wall_ms, "busy_ms": busy_ms,
                       "busy_ms_by_device": busy_by_device,
                       "kernels_per_round_by_device": kernels_per_round,
                       "fused_norm": os.environ.get("NINFER_TP_FUSED_NORM", "1") != "0",
                       "per_kind_ms": {k: v / 1e3 / args.steps for k, v in per_kind.items()},
                       "top": [(n, us / 1e3 / args.steps, c // args.steps) for n, (us, c) in top]}, f, indent=1)
    core.shutdown()


if __name__ == "__main__":
    main()
