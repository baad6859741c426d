"""Soak: N minutes of mixed traffic with random cancels and deadlines through a real gateway and engine
(separate processes), at concurrency C. Not a CI test: run it by hand and commit what it writes.

    python -m tools.serving.soak --minutes 10 --concurrency 4 --out bench/results/2026-11-30-soak-cpu

Reports every final status, and before/after figures of each process: RSS (from /proc), the engine's
KV (free blocks, block references taken/dropped), its queue (waiting/prefilling/running/parked),
finished requests by reason, the gateway's in-flight counts, and every ninfer_* gauge on /metrics.
Passes when, after the traffic, the engine is idle with all KV free and references balanced, no
handle expired its lease, the gateway has nothing in flight, and no status was INTERNAL or UNKNOWN.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import grpc

from gateway.client import GatewayClient, SamplingParams
from services.engine_client import EngineClient
from tools.serving.server_process import ServerProcess

ENGINE_ARGS = ("--kv-capacity", "4096", "--max-num-seqs", "8", "--max-pending", "32", "--pending-timeout-ms", "3000",
               "--lease-seconds", "10")
WORDS = "the quick brown fox jumps over a lazy dog while seven harbors count their boats at dawn".split()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def gauges(port: int | None) -> dict[str, float]:
    if port is None:
        return {}
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    types = {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE")}
    out = {}
    for line in text.splitlines():
        if line.startswith("ninfer_") and "_created" not in line.split(" ")[0] \
                and types.get(line.split("{")[0].split()[0]) == "gauge":
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def snapshot(engine_proc: ServerProcess, gateway_proc: ServerProcess, engine: EngineClient) -> dict:
    m = engine.wait_idle(timeout_s=15)
    q = m.queue
    return {
        "engine": {"rss_mib": round(rss_mib(engine_proc.proc.pid), 1),
                   "kv": {"num_blocks": m.kv.num_blocks, "free_blocks": m.kv.free_blocks,
                          "refs_taken": m.kv.refs_taken, "refs_dropped": m.kv.refs_dropped},
                   "queue": {"waiting": q.waiting, "prefilling": q.prefilling, "running": q.running, "parked": q.parked},
                   "finished": dict(m.performance.requests), "gauges": gauges(engine_proc.metrics_port)},
        "gateway": {"rss_mib": round(rss_mib(gateway_proc.proc.pid), 1), "gauges": gauges(gateway_proc.metrics_port)},
    }


def one_request(client: GatewayClient, rng: random.Random) -> str:
    kind = rng.random()
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.choice((3, 20, 200, 600))))
    sampling = SamplingParams(max_tokens=rng.randint(1, 64), ignore_eos=rng.random() < 0.7,
                              temperature=rng.choice((0.0, 0.7, 1.0)), seed=rng.randrange(1 << 30))
    timeout = rng.uniform(0.005, 0.3) if kind < 0.15 else 60.0
    if kind > 0.97:
        sampling.temperature = -1.0                              # INVALID_ARGUMENT
    if 0.90 < kind <= 0.95:
        call = client.generate(messages=[("system", "be brief"), ("user", prompt)], sampling=sampling, timeout=timeout)
    else:
        call = client.generate(prompt, sampling=sampling, timeout=timeout)
    timer = None
    if 0.15 <= kind < 0.40:                                        # cancel 0-80 ms in: across the handoff
        timer = threading.Timer(rng.uniform(0.0, 0.08), call.cancel)
        timer.start()
    try:
        for i, _ in enumerate(call):
            if 0.40 <= kind < 0.50 and i == rng.randint(0, 3):    # cancel after a few messages
                call.cancel()
        return "OK"
    except grpc.RpcError as e:
        return e.code().name
    finally:
        if timer is not None:
            timer.join()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for soak.json and soak.txt")
    args = p.parse_args(argv)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    metrics = ("--metrics-listen", "127.0.0.1:0")
    with ServerProcess.start("engine", *ENGINE_ARGS, *metrics, env=env) as engine_proc, \
            ServerProcess.start("gateway", "--engine", engine_proc.address, *metrics, env=env) as gateway_proc, \
            GatewayClient(gateway_proc.address) as client, EngineClient(engine_proc.address) as engine:
        client.wait_until_serving(timeout_s=120)
        before = snapshot(engine_proc, gateway_proc, engine)
        statuses: Counter[str] = Counter()
        lock = threading.Lock()
        end = time.monotonic() + args.minutes * 60

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < end:
                status = one_request(client, rng)
                with lock:
                    statuses[status] += 1

        start = time.monotonic()
        threads = [threading.Thread(target=worker, args=(args.seed * 1000 + i,)) for i in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - start
        time.sleep(1.0)
        after = snapshot(engine_proc, gateway_proc, engine)
        in_flight = [(e.engine, e.in_flight) for e in client_engine_metrics(client)]
    kv, q = after["engine"]["kv"], after["engine"]["queue"]
    checks = {
        "kv_all_free": kv["free_blocks"] == kv["num_blocks"],
        "refs_balanced": kv["refs_taken"] == kv["refs_dropped"],
        "queue_idle": not any(q.values()),
        "no_lease_expired": after["engine"]["finished"].get("lease_expired", 0) == 0,
        "gateway_in_flight_zero": all(n == 0 for _, n in in_flight),
        "no_internal_or_unknown": not (statuses["INTERNAL"] or statuses["UNKNOWN"]),
    }
    report = {"minutes": round(elapsed / 60, 2), "concurrency": args.concurrency, "seed": args.seed,
              "requests": sum(statuses.values()), "statuses": dict(statuses.most_common()),
              "gateway_in_flight_after": in_flight, "before": before, "after": after, "checks": checks,
              "passed": all(checks.values())}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "soak.json").write_text(text + "\n")
    return 0 if report["passed"] else 1


def client_engine_metrics(client: GatewayClient):
    from ninfer.v1 import gateway_pb2
    return client.stub.GetEngineMetrics(gateway_pb2.GetEngineMetricsRequest(), metadata=client.metadata,
                                        timeout=10).engines


if __name__ == "__main__":
    sys.exit(main())
