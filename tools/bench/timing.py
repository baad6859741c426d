"""Timing device work: events around the region on CUDA, a host clock after a synchronize elsewhere."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def time_fn(fn: Callable[[], object], device: str, warmup: int = 3, repeats: int = 10) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    if device.startswith("cuda"):
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def wall(fn: Callable[[], object], device: str) -> float:
    """Seconds of one call, the device drained before and after (host clock)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def graph_seconds(fns: list[Callable[[], object]], dry: bool = False) -> float:
    """Seconds per call of a kernel sweep's point: one CUDA graph of every fn in turn, median of 7 replays.
    dry (a CPU run of a sweep's logic): one call, a nominal millisecond."""
    if dry:
        fns[0]()
        return 1e-3
    for fn in fns[:2]:
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    t = time_fn(g.replay, "cuda", warmup=2, repeats=7)
    del g
    return sorted(t)[len(t) // 2] / len(fns)


def copy_bandwidth_Bps(device: str = "cuda") -> float:
    """Bytes per second (read + write) of a 1 GiB device-to-device copy, median of 10."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device, warmup=2, repeats=10)
    return 2 * (1 << 30) / sorted(t)[len(t) // 2]


def summary(values: list[float], higher_is_better: bool = True) -> dict:
    """Peak (the best repeat) and median of a list of figures."""
    if not values:
        return {"peak": None, "median": None, "n": 0}
    return {"peak": max(values) if higher_is_better else min(values), "median": statistics.median(values),
            "n": len(values)}
