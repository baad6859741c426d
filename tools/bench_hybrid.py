"""Hybrid bench section: `preset:qwen3.5-27b` (random weights) on the GPUs, TP=2 by default.

    python -m tools.bench_hybrid [--tp 2] [--contexts 4096,32768] [--out DIR]

For each context P: one request of P random tokens (fresh, no prefix reuse) and 64 decoded tokens
(ignore_eos, k = 0: random MTP weights accept nothing), rates from the request's own phase timings
(`prefill_tok_s = P / timings.prefill`, `decode_tok_s = 63 / timings.decode`). The decode floor is
the bytes one rank reads per token -- its weight shard, the KV of P tokens, and its linear-attention
state read and written once -- over the device-to-device copy bandwidth measured in the same run;
`roofline_fraction = floor time / measured time per token`. Written to OUT/hybrid_27b.json after
every point (a point that fails records its error and the rest still run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

PRESET = "preset:qwen3.5-27b"


def copy_bandwidth(device: str, nbytes: int = 1 << 31, repeats: int = 10) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy: the memory roofline."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from engine import LLM, SamplingParams

    out = Path(args.out) / "hybrid_27b.json"
    contexts = [int(c) for c in args.contexts.split(",")]
    res: dict = {"model": PRESET, "tp": args.tp, "dtype": "bfloat16", "draft_tokens": 0, "points": []}

    def save() -> None:
        out.write_text(json.dumps(res, indent=2))

    res["copy_bandwidth_bytes_s"] = copy_bandwidth("cuda:0")
    save()
    t0 = time.perf_counter()
    llm = LLM(PRESET, device="cuda", tensor_parallel_size=args.tp, max_batch=4, prefill_chunk=4096,
              kv_capacity=max(contexts) + 1024, max_model_len=max(contexts) + 256, prefix_reuse=False)
    res["load_s"] = time.perf_counter() - t0
    res["warmup"] = str(llm.warmup)
    plan = llm.engine.memory
    res["plan"] = plan.describe()
    res["state_bytes_per_request_per_rank"] = plan.state_bytes_per_slot
    save()
    gen = torch.Generator().manual_seed(0)
    for ctx in contexts:
        point: dict = {"context": ctx}
        try:
            ids = torch.randint(10, 200_000, (ctx,), generator=gen).tolist()
            o = llm.generate([ids], SamplingParams(max_tokens=64, ignore_eos=True))[0]
            s = o.stats
            point.update(prefill_tok_s=s.rates.prefill_tok_s, decode_tok_s=s.rates.decode_tok_s,
                         prefill_chunk=s.prefill_chunk, computed_prefill_tokens=s.usage.computed_prefill_tokens)
            read = plan.weights_bytes + (ctx + 32) * plan.kv_bytes_per_token + 2 * plan.state_bytes_per_slot
            floor_s = read / res["copy_bandwidth_bytes_s"]
            point.update(bytes_per_token_per_rank=read, floor_ms=floor_s * 1e3,
                         ms_per_token=1e3 / s.rates.decode_tok_s, roofline_fraction=floor_s * s.rates.decode_tok_s)
        except Exception as e:  # noqa: BLE001 - record it, keep the other points
            point["error"] = repr(e)
        res["points"].append(point)
        save()
    ok = [p for p in res["points"] if "roofline_fraction" in p]
    if ok:
        res["hybrid_27b_tp2_decode_roofline_fraction"] = ok[0]["roofline_fraction"]
    save()
    print(json.dumps(res, indent=2))
    llm.engine.executor.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
