"""What the gateway adds to time to first token and to inter-token latency, on this machine.

Starts `ninfer engine` and `ninfer gateway` as separate processes (as deployed), then sends the same
requests alternately (a) to the engine directly, Prefill then Decode, as the gateway does, and (b)
through the gateway's Generate stream. Both are timed by this client from the call to the first
token and between token messages; it reports medians (and p90) over the requests.

    python tools/serving/measure_gateway_overhead.py --requests 200 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from gateway.client import GatewayClient, SamplingParams
from tools.serving.server_process import ServerProcess
from services.engine_client import EngineClient


def timed_engine(engine: EngineClient, ids: list[int], sampling) -> tuple[float, float]:
    """(ttft, mean inter-token seconds) of Prefill + Decode called directly."""
    start = time.perf_counter()
    first = engine.prefill(ids, sampling)
    t_first = time.perf_counter()
    n, t_last = len(first.token_ids), t_first
    for msg in engine.decode(first.handle):
        if msg.token_ids:
            n, t_last = n + len(msg.token_ids), time.perf_counter()
    return t_first - start, (t_last - t_first) / max(1, n - 1)


def timed_gateway(client: GatewayClient, ids: list[int], sampling) -> tuple[float, float]:
    """(ttft, mean inter-token seconds) of one Generate stream (token ids in, so no tokenizer cost differs)."""
    start = time.perf_counter()
    t_first = t_last = None
    n = 0
    for msg in client.generate(prompt_token_ids=ids, sampling=sampling, include_token_ids=True):
        if msg.token_ids:
            t_last = time.perf_counter()
            t_first = t_first or t_last
            n += len(msg.token_ids)
    return t_first - start, (t_last - t_first) / max(1, n - 1)


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median_ms": statistics.median(ordered) * 1e3, "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=200, help="requests per path")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=10, help="requests per path not counted")
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--draft-tokens", type=int, default=0)
    args = p.parse_args(argv)

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    engine_args = ["--kv-capacity", "8192", "--draft-tokens", str(args.draft_tokens)]
    if args.model:
        engine_args += ["--model", args.model]
    with ServerProcess.start("engine", *engine_args, env=env) as engine_proc, \
            ServerProcess.start("gateway", "--engine", engine_proc.address,
                                env=env) as gateway_proc, \
            EngineClient(engine_proc.address) as engine, GatewayClient(gateway_proc.address) as client:
        client.wait_until_serving(timeout_s=300)
        tokenizer_vocab = engine.model_info().vocab_size
        sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        results = {"engine": {"ttft": [], "itl": []}, "gateway": {"ttft": [], "itl": []}}
        for i in range(args.warmup + args.requests):
            ids = [(i * 7 + j) % (tokenizer_vocab - 3) + 3 for j in range(12)]   # a fresh prompt each time
            order = [("engine", lambda: timed_engine(engine, ids, sampling)),
                     ("gateway", lambda: timed_gateway(client, ids, sampling))]
            for name, run in order if i % 2 else order[::-1]:                    # alternate who goes first
                ttft, itl = run()
                if i >= args.warmup:
                    results[name]["ttft"].append(ttft)
                    results[name]["itl"].append(itl)
    report = {name: {k: summary(v) for k, v in r.items()} for name, r in results.items()}
    report["added_ms"] = {k: report["gateway"][k]["median_ms"] - report["engine"][k]["median_ms"]
                          for k in ("ttft", "itl")}
    report["config"] = {"requests": args.requests, "max_tokens": args.max_tokens, "model": args.model or "embedded",
                        "draft_tokens": args.draft_tokens, "prompt_tokens": 12, "cpu_count": os.cpu_count()}
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
