"""Does a row-parallel projection pay for cuBLAS's split-K reduce kernel at decode sizes?

    python3 tools/splitk_probe.py

At TP=2 the per-rank o_proj and down_proj GEMVs run as a split-K GEMM plus a `splitKreduce_kernel`
(72 extra kernels per round on qwen3-8b: bench/results/2026-11-30-h200-tp2). If the projection
were instead a batched GEMM over S slices of K, producing S partial outputs, the fused all-reduce
could sum the S x world partials and the reduce kernel would go. This probe times, on one GPU in
CUDA graphs of 50 calls, F.linear against bmm over S = 2, 4, 8 slices for the TP=2 shard shapes,
and counts the kernels each launches. Prints a table; writes $OUT/splitk_probe.json.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

# (name, K per rank, N) of the TP=2 row-parallel shards
SHAPES = [("8b o_proj", 2048, 4096), ("8b down", 6144, 4096), ("32b o_proj", 4096, 5120), ("32b down", 12800, 5120)]


def _graph_us(fn, ops: int = 50, replays: int = 10) -> float:
    from tools.comm_check import graph_us
    return graph_us(fn, ops, replays)


def _kernels(fn) -> list[str]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def main() -> None:
    rows = []
    for name, k, n in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"shape": name, "M": m, "K": k, "N": n, "MB": n * k * 2 / 2**20}
            row["linear_us"] = _graph_us(lambda: F.linear(x, w))
            row["linear_kernels"] = _kernels(lambda: F.linear(x, w))
            for s in (2, 4, 8):
                if k % s:
                    continue
                ws = w.view(n, s, k // s).permute(1, 2, 0)          # [S, K/S, N], no copy
                xs = x.view(m, s, k // s).transpose(0, 1)           # [S, M, K/S]
                row[f"bmm{s}_us"] = _graph_us(lambda: torch.bmm(xs, ws))
                row[f"bmm{s}_kernels"] = len(_kernels(lambda: torch.bmm(xs, ws)))
            rows.append(row)
            gbps = row["MB"] * 2**20 / (row["linear_us"] * 1e-6) / 1e9
            best = min((row[f"bmm{s}_us"], s) for s in (2, 4, 8) if f"bmm{s}_us" in row)
            print(f"{name:11s} M={m}: linear {row['linear_us']:6.2f} us ({gbps:5.0f} GB/s, "
                  f"{len(row['linear_kernels'])} kernels: {', '.join(k_[:40] for k_ in row['linear_kernels'])}) | "
                  + " ".join(f"bmm{s} {row[f'bmm{s}_us']:6.2f} ({row[f'bmm{s}_kernels']}k)" for s in (2, 4, 8)
                             if f"bmm{s}_us" in row) + f" | best bmm{best[1]}", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "splitk_probe.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
