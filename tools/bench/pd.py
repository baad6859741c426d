"""Prefill/decode across engines (docs/disaggregation.md): the time to move a prompt's KV from a producer to
a consumer, and what a client sees through smg, one engine against a producer + consumer pair.

Three `ninfer engine` processes (a producer, a consumer, and a `--kv-role both` engine) and two smg routers
(`--pd-disaggregation` over the pair, plain over the single engine), all on 127.0.0.1, serving the small
trained model (smg needs its tokenizer). Streamed completions of about `prompt` tokens, `decode_tokens` out
(ignore_eos, a distinct prompt per stream and round: no prefix-cache hit), `streams` sent together, the two
routers taking turns for `reps` rounds (tools/bench/interleave.py): per round each side's median TTFT and
median inter-token gap as the client timed them (the first text event; the gaps between text events). The
ratios PD / single are derived per round, then their median (tools/bench/derive.py).

The transfer: every pull the consumer made, from its `kv_pulled` log line (blocks, bytes, seconds of the
READ and the lease check, GB/s), reduced to medians. On one host NIXL's UCX moves host memory between the
two processes (shared memory / CMA) while both engines compute: a CPU figure says the path works and what it
costs here, not what a link gives (the GPU run's `pd_kv_transfer_gbps`).
"""

from __future__ import annotations

import os
import statistics
from collections import Counter
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tools.bench import interleave
from tools.bench.progress import say

ROLES = ("producer", "consumer", "both")


def run(bench, sec: dict) -> None:
    from services.engine_client import EngineClient
    from tools.serving.server_process import ServerProcess
    from tools.serving.smg_stack import SmgRouter, smg_command

    plan = bench.plan.pd
    why = _why_not(bench, smg_command())
    if why:
        sec.update(status="skipped", reason=why)
        say("pd", why)
        return
    model = str(bench.acceptance_model)
    name = Path(model).name
    flags = ("--model", model, "--kv-capacity", str(plan.kv_capacity), "--max-num-seqs", str(max(plan.streams)),
             "--num-speculative-tokens", "0")
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if bench.kind == "cpu" else None
    # two GPUs: the consumer on the second, so that the pull crosses the link (NVLink / PCIe), not one device
    devices = {role: bench.device for role in ROLES}
    if bench.kind == "cuda" and bench.gpu_count() >= 2:
        devices["consumer"] = "cuda:1"

    def start(role: str) -> ServerProcess:
        proc = ServerProcess.start("engine", *flags, "--device", devices[role], "--kv-role", role, "--log-level",
                                   "info", env=env, timeout_s=900)
        with EngineClient(proc.address) as client:
            client.wait_until_serving(900)
        return proc

    with ThreadPoolExecutor(len(ROLES)) as pool:
        futures = {role: pool.submit(start, role) for role in ROLES}
    routers: list = []
    try:
        procs = {role: f.result() for role, f in futures.items()}
        logs = bench.out_dir / "pd-logs"
        logs.mkdir(parents=True, exist_ok=True)
        routers = [SmgRouter.start_pd([procs["producer"].address], [procs["consumer"].address], model,
                                      logs / "smg-pd.log"),
                   SmgRouter.start([procs["both"].address], model, logs / "smg-single.log")]
        for router, workers in zip(routers, (2, 1)):
            router.wait_until_ready(workers=workers, model=name, timeout_s=300)
        sides = dict(zip(("pd", "single"), routers))
        body = {"model": name, "prompt": _words(plan.prompt), "max_tokens": plan.decode_tokens, "temperature": 0,
                "ignore_eos": True}
        for router in sides.values():                   # the first requests through each path: not measured
            _stream(router, {**body, "prompt": "[warm] " + body["prompt"]})
        sec.update(model=name, prompt_tokens_about=plan.prompt, decode_tokens=plan.decode_tokens,
                   engines={"kv_capacity": plan.kv_capacity, "draft_tokens": 0, "device": bench.device,
                            "devices": devices})
        sec["streams"] = {}
        counter = iter(range(1 << 30))
        for n in plan.streams:
            calls = {label: (lambda r=side, n=n: _round(r, body, n, next(counter)))
                     for label, side in sides.items()}
            sec["streams"][str(n)] = interleave.run(calls, plan.reps, budget=bench.budget, round_s=30.0, streams=n)
            record = sec["streams"][str(n)]
            say("pd", f"{n} stream(s): TTFT ms single / PD {_med(record, 'single', 'ttft_ms_median')} / "
                      f"{_med(record, 'pd', 'ttft_ms_median')}; inter-token ms "
                      f"{_med(record, 'single', 'inter_token_ms_median')} / "
                      f"{_med(record, 'pd', 'inter_token_ms_median')}")
            bench.save()
        for r in routers:
            r.stop()
        procs["consumer"].terminate()                   # its log is complete once it has exited
        procs["consumer"].wait(60)
        events = procs["consumer"].events
        sec["transfer"] = transfer_figures([e for e in events if e.get("event") == "kv_pulled"])
        # what became of the decode legs' hand-offs: pulled, recomputed (stale lease, no room), failed
        sec["consumer_log"] = dict(Counter(e["event"] for e in events if str(e.get("event", "")).startswith("kv_")))
        sec["consumer_log"]["engine_request_done"] = sum(e.get("event") == "engine_request_done" for e in events)
        sec["consumer_log"]["unparsed_lines"] = len(procs["consumer"].other_lines)
        t = sec["transfer"]
        if t.get("pulls"):
            say("pd", f"{t['pulls']} pulls: {t['bytes_median'] / 1e6:.2f} MB in {t['ms_median']:.2f} ms median "
                      f"({t['gb_per_s_median']:.3f} GB/s)")
    finally:
        for r in routers:
            r.stop()
        for f in futures.values():
            if f.exception() is None and f.result().proc.poll() is None:
                f.result().terminate()
                f.result().wait(60)


def _why_not(bench, smg) -> str | None:
    if bench.plan.mode == "cpu-quick":
        return ("not in the quick CPU run (three engine processes and two routers: the CPU test's time budget); "
                "`python -m tools.bench --device cpu --sections pd` measures it")
    if bench.acceptance_model is None:
        return "the small trained model (its tokenizer, for smg) is not here"
    if smg is None:
        return "smg is not installed (the `test` extra installs it)"
    try:
        import nixl_cu12  # noqa: F401
    except ImportError:
        return "NIXL is not installed (`pip install 'ninfer[pd]'`)"
    return None


def _words(tokens: int) -> str:
    """About `tokens` tokens of plain words (the small model's tokenizer: about one token a word)."""
    return "the quick brown fox jumps over the lazy dog " * (tokens // 9 + 1)


def _stream(router, body: dict) -> tuple[float | None, list[float], str | None]:
    """(TTFT s, gaps between text events s, error) of one streamed completion, as its client saw it."""
    start = time.perf_counter()
    stamps: list[float] = []
    try:
        for event in router.stream_completion(body, timeout=600):
            if event.get("error"):
                return None, [], str(event["error"])[:200]
            if event.get("choices") and event["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 - a failed stream is a result
        return None, [], repr(e)[:200]
    if not stamps:
        return None, [], "no text"
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])], None


def _round(router, body: dict, n: int, round_no: int) -> dict:
    """`n` streams sent together (a distinct prompt each): the medians of their TTFTs and of all gaps."""
    results: list = [None] * n
    barrier = threading.Barrier(n)

    def one(i: int) -> None:
        barrier.wait()
        results[i] = _stream(router, {**body, "prompt": f"[{round_no}.{i}] " + body["prompt"]})
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    ttfts = [r[0] for r in results if r and r[0] is not None]
    gaps = [g for r in results if r for g in r[1]]
    return {"ttft_ms_median": statistics.median(ttfts) * 1e3 if len(ttfts) == n else None,
            "ttft_ms_max": max(ttfts) * 1e3 if ttfts else None,
            "inter_token_ms_median": statistics.median(gaps) * 1e3 if gaps else None,
            "errors": [r[2] for r in results if r and r[2]] + ["no answer"] * sum(r is None for r in results)}


def transfer_figures(pulls: list[dict]) -> dict:
    """Medians (and the 90th percentile of the time) over the consumer's `kv_pulled` lines."""
    if not pulls:
        return {"pulls": 0, "reason": "the consumer logged no pull"}
    ms = sorted(p["seconds"] * 1e3 for p in pulls)
    return {"pulls": len(pulls), "blocks_median": statistics.median(p["blocks"] for p in pulls),
            "bytes_median": statistics.median(p["bytes"] for p in pulls), "ms_median": statistics.median(ms),
            "ms_p90": ms[min(len(ms) - 1, int(0.9 * len(ms)))],
            "gb_per_s_median": statistics.median(p["gb_per_s"] for p in pulls),
            "per_pull": [{k: p[k] for k in ("blocks", "bytes", "seconds", "gb_per_s")} for p in pulls[:64]]}


def _med(record: dict, side: str, key: str) -> str:
    median = interleave.reduce_values(interleave.values(record, side, key), minimum=1)["value"]
    return "-" if median is None else f"{median:.1f}"
