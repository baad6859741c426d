"""One GPU run: a prefill chunk's attention after a long context, the engine's route against the paged kernel.

    python tools/dev/long_prefill_check.py [--contexts 32768,65536,131072,196608] [--chunk 4096] [--shapes 8b,32b]

Per shape (qwen3-8b: 32 q heads, qwen3-32b: 64, both 8 KV heads of 128; qwen3.5-27b's gated attention: 24 q heads,
4 KV heads of 256), pages of 16, per KV dtype (bf16, int8) and context, one layer's call of `paged_attention` for a chunk of new tokens after `context` keys:
  route   the engine's choice (engine.kernels.attention.paged): past PREFILL_GATHER_MAX_BYTES one sequence takes the
          TMA kernel segment by segment (prefill_segments), int8 pages dequantized by the gather;
  paged   the paged kernel, forced by an explicit plan (the route of before for these shapes);
median of CUDA-event timings after a warm-up, TFLOP/s = 4 * heads * head_dim per visible (query, key) pair, and
the relative error of route against paged. Prints a table; --out writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SHAPES = {"8b": (32, 8, 128), "32b": (64, 8, 128), "27b": (24, 4, 256)}     # q heads, KV heads, head_dim
PAGE = 16


def timed(fn, reps: int) -> float:
    """ms, median of reps CUDA-event timings after one untimed call."""
    from tools.bench.timing import time_fn
    return statistics.median(time_fn(fn, "cuda", warmup=1, repeats=reps)) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="32768,65536,131072,196608")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--shapes", default="8b,32b")
    ap.add_argument("--dtypes", default="bf16,int8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hd256", action="store_true", help="head_dim 256 on the TMA routes even under NINFER_PREFILL_TMA_HD256=0")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from engine.kernels.attention import paged as A
    if args.hd256:
        A.PREFILL_TMA_HEAD_DIMS = (128, 256)
    from tests.support.kernel_checks import attention_case, rel_err
    rows = []
    for shape in args.shapes.split(","):
        heads, kvh, d = SHAPES[shape]
        for dtype in args.dtypes.split(","):
            kv_dtype = torch.int8 if dtype == "int8" else torch.bfloat16
            for context in (int(c) for c in args.contexts.split(",")):
                keys = context + args.chunk
                q, kv, ctx = attention_case([args.chunk], [keys], heads, kvh, d, PAGE, kv_dtype, torch.bfloat16,
                                            "cuda", seed=1)
                scale = d ** -0.5
                segment_keys = A.prefill_segment_keys(q, kv, ctx)
                route = ("gather" if A.takes_tma_prefill(q, kv, ctx)
                         else f"segments of {segment_keys}" if segment_keys else "paged")
                paged_cfg = A.plan(q, kv, ctx)
                out_route = A.paged_attention(q, kv, ctx, scale)
                out_paged = A.paged_attention(q, kv, ctx, scale, config=paged_cfg)
                err = rel_err(out_route, out_paged)
                ms_route = timed(lambda: A.paged_attention(q, kv, ctx, scale, out=out_route), args.reps)
                ms_paged = timed(lambda: A.paged_attention(q, kv, ctx, scale, out=out_paged, config=paged_cfg),
                                 args.reps)
                flops = A.attention_flops([keys], [args.chunk], heads, d)
                row = dict(shape=shape, kv=dtype, context=context, chunk=args.chunk, route=route,
                           route_ms=ms_route, paged_ms=ms_paged, speedup=ms_paged / ms_route,
                           route_tflops=flops / ms_route / 1e9, paged_tflops=flops / ms_paged / 1e9, rel_err=err)
                rows.append(row)
                print(f"{shape:4} {dtype:5} ctx {context:7} +{args.chunk}: {route:18} {ms_route:8.2f} ms "
                      f"({row['route_tflops']:4.0f} TFLOP/s)  paged {ms_paged:8.2f} ms ({row['paged_tflops']:4.0f})  "
                      f"x{row['speedup']:.2f}  rel_err {err:.1e}", flush=True)
                del q, kv, ctx, out_route, out_paged
                torch.cuda.empty_cache()
    if args.out:
        info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
        args.out.write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
