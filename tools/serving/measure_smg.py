"""Time to first token and inter-token time through Shepherd Model Gateway (smg) against ninfer's
own gateway, on the same two engine processes, on this machine.

Starts two `ninfer engine` processes, `ninfer gateway` over both, and `smg launch --policy
cache_aware` over both (grpc:// workers, services/smg). Then sends the same prompts, one request at
a time and alternating who goes first, (a) through ninfer's gateway (gRPC Generate stream, text
in), (b) through smg (OpenAI /v1/completions, SSE, text in) and (c) straight to one engine's smg
protocol (VllmEngine Generate, token ids in: the servicer without a router). Each is timed by this
client from sending to the first token and between token messages; it reports medians (and p90).
Prompts are short and distinct, so no request gets a prefix-cache hit.

    python -m tools.serving.measure_smg --requests 50 --max-tokens 32 --out bench/results/<date>-smg-cpu
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb, vllm_engine_pb2_grpc

from gateway.client import GatewayClient, SamplingParams
from tools.serving.server_process import ServerProcess
from services.engine_client import EngineClient
from tools.serving.smg_stack import SmgRouter

DEFAULT_MODEL = Path(__file__).resolve().parents[3] / "shared/models/tiny-qwen3-mtp"
WORDS = ["river", "window", "garden", "silver", "yellow", "engine", "market", "planet", "signal", "forest"]


def prompt_for(i: int) -> str:
    return f"{WORDS[i % 10]} {WORDS[(i // 10) % 10]} {i}: the"


def timed_gateway(client: GatewayClient, prompt: str, max_tokens: int) -> tuple[float, float]:
    start = time.perf_counter()
    t_first = t_last = None
    for msg in client.generate(prompt, sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                ignore_eos=True), timeout=120):
        if msg.text:
            t_last = time.perf_counter()
            t_first = t_first or t_last
    return t_first - start, (t_last - t_first) / max(1, max_tokens - 1)


def timed_smg(router: SmgRouter, model: str, prompt: str, max_tokens: int) -> tuple[float, float]:
    start = time.perf_counter()
    t_first = t_last = None
    for event in router.stream_completion({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                           "temperature": 0, "ignore_eos": True}, timeout=120):
        if event.get("choices") and event["choices"][0].get("text"):
            t_last = time.perf_counter()
            t_first = t_first or t_last
    return t_first - start, (t_last - t_first) / max(1, max_tokens - 1)


def timed_servicer(stub, ids: list[int], max_tokens: int) -> tuple[float, float]:
    start = time.perf_counter()
    t_first = t_last = None
    request = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=ids), stream=True, sampling_params=pb.SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    for msg in stub.Generate(request, timeout=120):
        if msg.WhichOneof("response") == "chunk" and msg.chunk.token_ids:
            t_last = time.perf_counter()
            t_first = t_first or t_last
    return t_first - start, (t_last - t_first) / max(1, max_tokens - 1)


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p90 = ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]            # nearest rank
    return {"median_ms": statistics.median(ordered) * 1e3, "p90_ms": p90 * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=50, help="requests per path")
    p.add_argument("--warmup", type=int, default=5, help="requests per path not counted")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory (smg needs its tokenizer files)")
    p.add_argument("--draft-tokens", type=int, default=2, help="MTP draft tokens of the engines")
    p.add_argument("--out", default=None, help="directory for result.json (and smg.log)")
    args = p.parse_args(argv)

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    engine_args = ["--model", args.model, "--kv-capacity", "4096", "--draft-tokens", str(args.draft_tokens)]
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="measure-smg-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    engines = [ServerProcess.start("engine", *engine_args, env=env) for _ in range(2)]
    try:
        for e in engines:
            with EngineClient(e.address) as c:
                c.wait_until_serving(timeout_s=300)
        model = Path(args.model).name
        with ServerProcess.start("gateway", "--engine", ",".join(e.address for e in engines), env=env) as gw, \
                SmgRouter.start([e.address for e in engines], args.model, out_dir / "smg.log") as router, \
                GatewayClient(gw.address) as client, grpc.insecure_channel(engines[0].address) as channel, \
                EngineClient(engines[0].address) as engine0:
            client.wait_until_serving(timeout_s=60)
            router.wait_until_ready(workers=2, model=model)
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            tokenize = _tokenizer(args.model)
            results = {"ninfer_gateway": {"ttft": [], "itl": []}, "smg": {"ttft": [], "itl": []},
                       "engine_smg_protocol": {"ttft": [], "itl": []}}
            for i in range(args.warmup + args.requests):
                prompt = prompt_for(i)
                runs = [("ninfer_gateway", lambda: timed_gateway(client, prompt, args.max_tokens)),
                        ("smg", lambda: timed_smg(router, model, prompt, args.max_tokens)),
                        ("engine_smg_protocol", lambda: timed_servicer(stub, tokenize(prompt), args.max_tokens))]
                for name, run in runs if i % 2 else runs[::-1]:
                    ttft, itl = run()
                    if i >= args.warmup:
                        results[name]["ttft"].append(ttft)
                        results[name]["itl"].append(itl)
            acceptance = list(engine0.metrics().performance.acceptance_per_position)
    finally:
        for e in engines:
            e.terminate()
            e.wait(60)
    report = {name: {k: summary(v) for k, v in r.items()} for name, r in results.items()}
    report["smg_minus_ninfer_gateway_ms"] = {k: report["smg"][k]["median_ms"] - report["ninfer_gateway"][k]["median_ms"]
                                             for k in ("ttft", "itl")}
    report["config"] = {
        "requests": args.requests, "warmup": args.warmup, "max_tokens": args.max_tokens, "model": model,
        "draft_tokens": args.draft_tokens, "engine0_acceptance_per_position": acceptance, "engines": 2,
        "policy": "cache_aware", "smg": _version("smg"), "smg_grpc_proto": _version("smg-grpc-proto"),
        "commit": _commit(), "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, no GPU",
        "omp_num_threads": env["OMP_NUM_THREADS"], "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    text = json.dumps(report, indent=2)
    (out_dir / "result.json").write_text(text + "\n")
    print(text)
    return 0


def _tokenizer(model_dir: str):
    from tokenizers import Tokenizer
    inner = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return lambda text: inner.encode(text, add_special_tokens=False).ids


def _version(dist: str) -> str:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
