"""Host time of short eager prefills: cProfile of a few prefills of P fresh tokens (one chunk each).

    python3 tools/dev/profile_prefill_host.py [--prompt 512] [--model preset:qwen3-8b] [--device cuda]

A 512-token prefill of qwen3-8b was found host-bound on an H200 this way (26 ms of wall time for 11 ms of GPU
work: bench/results/2026-12-02-h200-bench-profiles/h-ede9fe5-prefill-host-profile). Prints the wall time of five prefills,
then the profile of five more, sorted by own time and by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

from engine.config import EngineConfig
from engine.core import EngineCore
from tools.dev.profile_prefill import prefill_once


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens P")
    parser.add_argument("--model", default="preset:qwen3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--chunk", type=int, default=4096, help="prefill chunk (at least P: one chunk)")
    args = parser.parse_args()
    core = EngineCore(EngineConfig(model=args.model, device=args.device, draft_tokens=0, max_batch=4,
                                   prefill_chunk=args.chunk, kv_capacity=8192, max_model_len=4096))
    core.warmup()
    for i in range(3):
        prefill_once(core, args.prompt, seed=i)
    walls = [prefill_once(core, args.prompt, seed=10 + i) for i in range(5)]
    print("wall ms", [round(w * 1e3, 2) for w in walls])
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(5):
        prefill_once(core, args.prompt, seed=20 + i)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(60)
    print(out.getvalue()[:28000])


if __name__ == "__main__":
    main()
