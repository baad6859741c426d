"""The physical limits, measured in the same run: copy bandwidth and the bf16 matmul rate.

- copy: one large device-to-device copy; bytes moved = bytes read + bytes written (2 x size).
- matmul: n x n x n on random data (zeros run faster than real data), 2 n^3 FLOPs per call.
- gemv: one vector times a [vocab, hidden] weight, the shape of a batch-1 lm_head; bytes = the
  weight's. Informational: how close a plain library GEMV gets to the copy bandwidth.
Each figure is the median of `repeats` timed calls after a warm-up (device events on CUDA).
"""

from __future__ import annotations

import torch

from tools.bench.plan import RooflinePlan
from tools.bench.progress import say, si
from tools.bench.timing import summary, time_fn


def run(bench, sec: dict) -> None:
    plan: RooflinePlan = bench.plan.roofline
    dev = bench.device
    gen = torch.Generator(dev).manual_seed(1234)
    sec["copy"] = copy_bandwidth(plan, dev, gen)
    say("roofline", f"copy bandwidth {si(sec['copy']['bandwidth_Bps'], 'B/s')} (median of {sec['copy']['repeats']}, "
                    f"{sec['copy']['bytes_moved'] / 2**30:.1f} GiB moved per copy)")
    bench.save()
    sec["matmul"] = matmul_rate(plan, dev, gen)
    say("roofline", f"matmul {plan.matmul_n}^3 {plan.matmul_dtype}: {si(sec['matmul']['flops_per_s'], 'FLOP/s')} "
                    f"(median of {sec['matmul']['repeats']})")
    bench.save()
    sec["gemv"] = gemv_bandwidth(plan, dev, gen)
    say("roofline", f"gemv [{plan.gemv_rows}x{plan.gemv_cols}] bf16: {si(sec['gemv']['bandwidth_Bps'], 'B/s')}")
    # kept with the run too, so that a report merging runs derives each section against its own run's limits
    bench.results["run"]["roofline"] = {"bandwidth_Bps": sec["copy"]["bandwidth_Bps"],
                                        "flops_per_s": sec["matmul"]["flops_per_s"]}
    sec["status"] = "ok"


def copy_bandwidth(plan: RooflinePlan, dev: str, gen: torch.Generator) -> dict:
    src = torch.randn(plan.copy_bytes // 2, dtype=torch.bfloat16, device=dev, generator=gen)
    dst = torch.empty_like(src)
    times = time_fn(lambda: dst.copy_(src), dev, warmup=3, repeats=plan.repeats)
    size = src.numel() * src.element_size()
    rates = [2 * size / t for t in times]
    return {"bytes_moved": 2 * size, "buffer_bytes": size, "repeats": len(times),
            "bandwidth_Bps": summary(rates)["median"], "bandwidth_Bps_peak": max(rates),
            "times_s": [round(t, 7) for t in times]}


def matmul_rate(plan: RooflinePlan, dev: str, gen: torch.Generator) -> dict:
    n = plan.matmul_n
    dtype = getattr(torch, plan.matmul_dtype)
    # two input sets, alternated: the next call never finds its operands in the cache
    pairs = [(torch.randn(n, n, dtype=dtype, device=dev, generator=gen),
              torch.randn(n, n, dtype=dtype, device=dev, generator=gen)) for _ in range(2)]
    out = torch.empty(n, n, dtype=dtype, device=dev)
    calls = iter(range(1 << 30))

    def mm():
        a, b = pairs[next(calls) % len(pairs)]
        torch.matmul(a, b, out=out)
    times = time_fn(mm, dev, warmup=5, repeats=max(10, plan.repeats))
    rates = [2 * n ** 3 / t for t in times]
    return {"n": n, "dtype": plan.matmul_dtype, "repeats": len(times), "flops_per_s": summary(rates)["median"],
            "flops_per_s_peak": max(rates), "times_s": [round(t, 7) for t in times]}


def gemv_bandwidth(plan: RooflinePlan, dev: str, gen: torch.Generator) -> dict:
    w = torch.randn(plan.gemv_rows, plan.gemv_cols, dtype=torch.bfloat16, device=dev, generator=gen)
    x = torch.randn(1, plan.gemv_cols, dtype=torch.bfloat16, device=dev, generator=gen)
    times = time_fn(lambda: torch.nn.functional.linear(x, w), dev, warmup=3, repeats=plan.repeats)
    rates = [w.numel() * w.element_size() / t for t in times]
    return {"shape": [plan.gemv_rows, plan.gemv_cols], "bandwidth_Bps": summary(rates)["median"],
            "repeats": len(times)}
