"""Prefill/decode across engines measured on this machine (docs/disaggregation.md, "Measured"): the KV pull
per prompt (bytes, ms, GB/s, from the consumer's `kv_pulled` log) and TTFT / inter-token time of streamed
completions through smg, one engine (`--kv-role both`) against a producer + consumer pair, at 1 and 8
concurrent streams. Every engine is its own `ninfer engine` process on 127.0.0.1.

    python -m tools.serving.measure_pd --model ../shared/models/tiny-qwen3-mtp [--prompt-tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from services.engine_client import EngineClient
from tools.serving.server_process import ServerProcess
from tools.serving.smg_stack import SmgRouter


def stream_timings(router: SmgRouter, body: dict) -> tuple[float, list[float]]:
    """(TTFT, gaps between text events) of one streamed completion, in seconds."""
    start = time.perf_counter()
    stamps = [time.perf_counter() for e in router.stream_completion(body, timeout=300)
              if e.get("choices") and e["choices"][0].get("text")]
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])]


def run_streams(router: SmgRouter, body: dict, streams: int, rounds: int) -> dict:
    ttfts, gaps = [], []
    lock = threading.Lock()

    def one(i: int) -> None:
        for r in range(rounds):
            # a distinct prompt per stream and round: no prefix-cache hit between them
            t, g = stream_timings(router, {**body, "prompt": f"[{i}.{r}] " + body["prompt"]})
            with lock:
                ttfts.append(t)
                gaps.extend(g)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"streams": streams, "requests": len(ttfts), "ttft_ms_median": statistics.median(ttfts) * 1e3,
            "inter_token_ms_median": statistics.median(gaps) * 1e3 if gaps else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="about this many prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the results here as JSON")
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ("--model", args.model, "--kv-capacity", str(4 * 8 * (args.prompt_tokens + args.max_tokens + 64)))
    procs = {role: ServerProcess.start("engine", *common, "--kv-role", role, env=env)
             for role in ("producer", "consumer", "both")}
    routers: list[SmgRouter] = []
    logs = Path(tempfile.mkdtemp(prefix="measure-pd-"))
    try:
        for p in procs.values():
            with EngineClient(p.address) as c:
                c.wait_until_serving(timeout_s=120)
        pd = SmgRouter.start_pd([procs["producer"].address], [procs["consumer"].address], args.model,
                                logs / "smg-pd.log")
        single = SmgRouter.start([procs["both"].address], args.model, logs / "smg.log")
        routers = [pd, single]
        name = Path(args.model).name
        pd.wait_until_ready(workers=2, model=name, timeout_s=120)
        single.wait_until_ready(workers=1, model=name, timeout_s=120)
        words = "the quick brown fox jumps over the lazy dog " * (args.prompt_tokens // 9 + 1)
        body = {"model": name, "prompt": words, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
        results: dict = {"model": name, "prompt_tokens_about": args.prompt_tokens, "max_tokens": args.max_tokens}
        for label, router in (("single", single), ("pd", pd)):
            stream_timings(router, body)                          # warm both paths once
            results[label] = [run_streams(router, body, n, args.rounds) for n in (1, 8)]
        pulls = [e for e in procs["consumer"].events if e.get("event") == "kv_pulled"]
        results["pulls"] = {"count": len(pulls), "bytes_median": statistics.median(e["bytes"] for e in pulls),
                            "ms_median": statistics.median(e["seconds"] for e in pulls) * 1e3,
                            "gb_per_s_median": statistics.median(e["gb_per_s"] for e in pulls)} if pulls else None
    finally:
        for r in routers:
            r.stop()
        for p in procs.values():
            p.terminate()
            p.wait(30)
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
