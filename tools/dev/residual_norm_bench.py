"""What the float32 residual stream of --dtype float16 costs the RMSNorm + residual add (engine.kernels.elementwise.
norm_rope.rms_norm) at Qwen3.5-27B's hidden size, against float16 and bfloat16 streams. On a GPU:

    python -m tools.dev.residual_norm_bench [--out OUT.json]

Per variant (activation / stream dtype) and row count: the median of 7 replays of a CUDA graph of 200 launches,
the variants interleaved within each replay round, and the bytes moved per microsecond (x, out, stream in, stream
out).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from engine.kernels.elementwise.norm_rope import rms_norm

HIDDEN = 5120
VARIANTS = {"bf16/bf16": (torch.bfloat16, torch.bfloat16), "fp16/fp16": (torch.float16, torch.float16),
            "fp16/fp32": (torch.float16, torch.float32)}


def graph_of(rows: int, x_dtype: torch.dtype, stream_dtype: torch.dtype, launches: int) -> tuple[torch.cuda.CUDAGraph, int]:
    """A CUDA graph of `launches` norms of [rows, HIDDEN], and the bytes one launch moves."""
    x = torch.randn(rows, HIDDEN, device="cuda").to(x_dtype)
    stream = torch.randn(rows, HIDDEN, device="cuda").to(stream_dtype)
    weight = torch.rand(HIDDEN, device="cuda").to(x_dtype)
    out, stream_out = torch.empty_like(x), torch.empty_like(stream)
    for _ in range(3):                                             # compile and warm up outside the graph
        rms_norm(x, weight, 1e-6, stream, out=out, residual_out=stream_out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            rms_norm(x, weight, 1e-6, stream, out=out, residual_out=stream_out)
    return graph, rows * HIDDEN * 2 * (x.element_size() + stream.element_size())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,64,512,2048")
    parser.add_argument("--out")
    args = parser.parse_args()
    launches, results = 200, {}
    for rows in (int(r) for r in args.rows.split(",")):
        graphs = {name: graph_of(rows, *dtypes, launches) for name, dtypes in VARIANTS.items()}
        times: dict[str, list[float]] = {name: [] for name in graphs}
        for _ in range(7):
            for name, (graph, _) in graphs.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end) * 1000 / launches)
        for name, (_, nbytes) in graphs.items():
            us = statistics.median(times[name])
            results[f"{name} rows={rows}"] = {"us": round(us, 3), "GB/s": round(nbytes / us / 1e3, 1)}
            print(f"{name:10s} rows {rows:5d}: {us:8.3f} us {nbytes / us / 1e3:8.1f} GB/s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "hidden": HIDDEN, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
