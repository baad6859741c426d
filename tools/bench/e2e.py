"""End to end: the deployed shape against the in-process engine, in the same run.

`ninfer engine` and `ninfer gateway` run as separate processes (as a platform deploys them) and a
gRPC client drives them through the gateway; the in-process side is the `EngineLoop` the same flags
build, warmed up the same way. For each (TP, k): the time to first token of a prompt alone (median
of several), one stream's decode, and the aggregate of 8 and 32 streams sent together. Both sides
are timed by their client alike: TTFT from the call to the first token; a stream's decode rate from
its first to its last token, (tokens - 1) / seconds; the aggregate is the sum over the streams.

Every final message through the gateway is checked against itself and against the client:
    prefill_tok_s = computed_prefill_tokens / prefill_seconds,  prefill_seconds <= ttft_seconds,
    engine TTFT <= gateway TTFT <= the client's TTFT,  the client's decode rate <= the engine's
(the engine's decode window lies inside the client's). Violations are counted and kept.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.request_stats import RequestStats
from tools.bench.progress import fmt_rate, say
from tools.bench.session import compact, random_prompt

TOLERANCE = 1e-6          # relative, for identities of floating-point figures
CLIENT_RATE_SLACK = 1.05  # the client's decode rate may exceed the engine's by clock jitter only


@dataclass
class StreamTiming:
    """One request as its client saw it."""

    ttft_s: float | None = None
    first_at: float | None = None
    last_at: float | None = None
    tokens: int = 0
    stats: RequestStats | None = None               # the engine's figures (in the final message)
    gateway_ttft_s: float | None = None             # the gateway's own (e2e only)
    error: str | None = None

    def tokens_arrived(self, n: int, now: float, start: float) -> None:
        """`n` tokens reached the client at `now` (perf_counter seconds; the call began at `start`)."""
        if not n:
            return
        if self.first_at is None:
            self.first_at, self.ttft_s = now, now - start
        self.last_at = now
        self.tokens += n

    @property
    def decode_tok_s(self) -> float | None:
        if self.tokens < 2 or self.last_at is None or self.last_at <= self.first_at:
            return None
        return (self.tokens - 1) / (self.last_at - self.first_at)


@dataclass
class PathResult:
    ttft_ms: list[float] = field(default_factory=list)
    points: dict[int, list[StreamTiming]] = field(default_factory=dict)     # streams -> timings


# -- the two clients --------------------------------------------------------------------------------

def inproc_stream(loop, ids: list[int], params: SamplingParams, timing: StreamTiming) -> None:
    start = time.perf_counter()
    for out in loop.submit(ids, params):
        timing.tokens_arrived(len(out.new_token_ids), time.perf_counter(), start)
        if out.finished:
            timing.stats = out.stats


def gateway_stream(client, ids: list[int], params: SamplingParams, timing: StreamTiming) -> None:
    from gateway.client import SamplingParams as WireSampling
    from services.convert import stats_from_proto
    wire = WireSampling(max_tokens=params.max_tokens, ignore_eos=params.ignore_eos)
    start = time.perf_counter()
    for msg in client.generate(prompt_token_ids=ids, sampling=wire, include_token_ids=True):
        timing.tokens_arrived(len(msg.token_ids), time.perf_counter(), start)
        if msg.HasField("result"):
            timing.stats = stats_from_proto(msg.result.stats)
            timing.gateway_ttft_s = msg.result.gateway_timings.ttft_seconds


def run_together(one, prompts: list[list[int]], params: SamplingParams, timeout: float) -> list[StreamTiming]:
    """Start every stream at once (one thread each, behind a barrier) and wait for all."""
    timings = [StreamTiming() for _ in prompts]
    barrier = threading.Barrier(len(prompts))

    def go(ids, timing):
        barrier.wait()
        try:
            one(ids, params, timing)
        except Exception as e:  # noqa: BLE001 - a failed stream is a result
            timing.error = repr(e)[:300]

    threads = [threading.Thread(target=go, args=(p, t), daemon=True) for p, t in zip(prompts, timings)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return timings


def measure(one, vocab: int, plan, timeout: float) -> PathResult:
    result = PathResult()
    ttft_params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
    for _ in range(plan.ttft_repeats):
        t = StreamTiming()
        one(random_prompt(plan.prompt, vocab), ttft_params, t)
        result.ttft_ms.append(t.ttft_s * 1e3)
    params = SamplingParams(max_tokens=plan.decode_tokens, ignore_eos=True, temperature=0.0)
    for n in plan.streams:
        result.points[n] = run_together(one, [random_prompt(plan.prompt, vocab) for _ in range(n)], params, timeout)
    return result


# -- checks -----------------------------------------------------------------------------------------

def consistency(t: StreamTiming) -> list[str]:
    """What a final message through the gateway says that cannot be true."""
    s = t.stats
    if s is None:
        return [f"no final stats ({t.error or 'stream ended early'})"]
    bad = []
    u, tm = s.usage, s.timings
    if tm.prefill > 0 and u.computed_prefill_tokens:
        want = u.computed_prefill_tokens / tm.prefill
        if abs(s.rates.prefill_tok_s - want) > TOLERANCE * want:
            bad.append(f"prefill_tok_s {s.rates.prefill_tok_s:.1f} != computed {u.computed_prefill_tokens} / "
                       f"prefill {tm.prefill:.4f} s")
    if tm.prefill > tm.ttft * (1 + TOLERANCE):
        bad.append(f"prefill_seconds {tm.prefill:.4f} > ttft_seconds {tm.ttft:.4f}")
    if t.gateway_ttft_s is not None and not tm.ttft <= t.gateway_ttft_s * (1 + TOLERANCE) + 1e-6:
        bad.append(f"engine ttft {tm.ttft:.4f} > gateway ttft {t.gateway_ttft_s:.4f}")
    if t.gateway_ttft_s is not None and t.ttft_s is not None and not t.gateway_ttft_s <= t.ttft_s + 1e-6:
        bad.append(f"gateway ttft {t.gateway_ttft_s:.4f} > client ttft {t.ttft_s:.4f}")
    if t.tokens != u.completion_tokens:
        bad.append(f"client counted {t.tokens} tokens, the engine {u.completion_tokens}")
    client = t.decode_tok_s
    if client and s.rates.decode_tok_s and client > s.rates.decode_tok_s * CLIENT_RATE_SLACK:
        bad.append(f"client decode {client:.1f} tok/s > engine decode_tok_s {s.rates.decode_tok_s:.1f}")
    return bad


def summarize(result: PathResult) -> dict:
    out = {"ttft_ms_median": statistics.median(result.ttft_ms), "ttft_ms": [round(x, 3) for x in result.ttft_ms],
           "streams": {}}
    for n, timings in result.points.items():
        rates = [t.decode_tok_s for t in timings if t.decode_tok_s]
        out["streams"][str(n)] = {
            "aggregate_tok_s": sum(rates) if len(rates) == n else None,
            "per_stream_tok_s_mean": statistics.mean(rates) if rates else None,
            "errors": [t.error for t in timings if t.error],
            "engine_decode_tok_s_mean": statistics.mean([t.stats.rates.decode_tok_s for t in timings if t.stats])
            if any(t.stats for t in timings) else None,
            "records": [{**(compact(t.stats) if t.stats else {}), "client_ttft_s": t.ttft_s,
                         "client_decode_tok_s": t.decode_tok_s, "gateway_ttft_s": t.gateway_ttft_s}
                        for t in timings]}
    return out


# -- the section ------------------------------------------------------------------------------------

def engine_flags(bench, tp: int, k: int, draft_vocab: int) -> list[str]:
    plan = bench.plan.e2e
    return ["--model", bench.model, "--device", bench.device, "--kv-capacity", str(plan.kv_capacity),
            "--max-model-len", str(plan.kv_capacity), "--prefill-chunk", str(bench.plan.chunk),
            "--max-num-seqs", str(max(plan.streams)), "--num-speculative-tokens", str(k),
            "--draft-vocab", str(draft_vocab), "--tensor-parallel-size", str(tp)]


def run(bench, sec: dict) -> None:
    from gateway.client import GatewayClient
    from tools.serving.server_process import ServerProcess

    plan = bench.plan.e2e
    gpus = bench.gpu_count()
    configs = sec.setdefault("configs", [])
    for tp in plan.tps:
        if tp > max(gpus, 1) or (tp > 1 and bench.kind == "cpu"):
            configs.append({"tp": tp, "skipped": f"needs {tp} GPUs ({gpus} visible)"})
            continue
        for k in plan.ks:
            dv = plan.draft_vocab if k > 0 else 0
            label = f"tp{tp}-k{k}"
            est = 2 * bench.build_guess_s() + 30
            if not bench.budget.allows(est):
                configs.append({"label": label, "skipped": bench.budget.skip_reason(est)})
                continue
            timeout = max(120.0, 60 * plan.decode_tokens * (0.05 if bench.kind == "cpu" else 0.01))
            spec = bench.engine_spec(draft_tokens=k, draft_vocab=dv, tensor_parallel_size=tp,
                                     kv_capacity=plan.kv_capacity, max_model_len=plan.kv_capacity,
                                     max_batch=max(plan.streams))
            session, _ = bench.pool.get(spec, warm_prompt=plan.prompt, warm_decode=16)
            inproc = measure(lambda ids, p, t: inproc_stream(session.loop, ids, p, t), session.vocab, plan, timeout)
            engine_info = session.describe
            bench.pool.close()                        # the device's memory goes to the engine process
            with ServerProcess.start("engine", *engine_flags(bench, tp, k, dv), "--log-level", "info",
                                     timeout_s=900) as engine, \
                    ServerProcess.start("gateway", "--engine", engine.address) as gateway, \
                    GatewayClient(gateway.address) as client:
                client.wait_until_serving(900)
                e2e = measure(lambda ids, p, t: gateway_stream(client, ids, p, t), session.vocab, plan, timeout)
                served = engine.wait_for_event("engine_serving")
            violations = [f"{n} streams: {v}" for n, timings in e2e.points.items() for t in timings
                          for v in consistency(t)]
            entry = {"label": label, "tp": tp, "k": k, "draft_vocab": dv, "prompt": plan.prompt,
                     "decode_tokens": plan.decode_tokens, "inproc": summarize(inproc), "e2e": summarize(e2e),
                     "engine": engine_info, "served_engine_warmup": {key: served.get(key) for key in
                     ("cuda_graphs", "graph_buckets", "graph_capture_seconds", "no_graphs_reason", "warmup_seconds")},
                     "consistency_violations": violations[:200], "consistency_violation_count": len(violations),
                     "messages_checked": sum(len(v) for v in e2e.points.values())}
            ratios(entry)
            configs.append(entry)
            say("e2e", f"{label}: decode 1 stream {fmt_rate(entry['decode_b1_ratio_inputs'][0])} in-process vs "
                       f"{fmt_rate(entry['decode_b1_ratio_inputs'][1])} served; TTFT +{entry['ttft_added_ms']:.2f} ms; "
                       f"{len(violations)} inconsistent of {entry['messages_checked']} final messages")
            bench.save()
    ref = next((c for c in configs if c.get("label") == "tp1-k0"), None)
    if ref is None:
        sec["e2e_reason"] = "the TP=1, k=0 configuration was not measured"
        return
    sec["e2e_decode_b1_over_inproc"] = ref["decode_b1_over_inproc"]
    sec["e2e_agg_8_over_inproc"] = ref["agg_8_over_inproc"]
    sec["e2e_ttft_added_ms"] = ref["ttft_added_ms"]
    for name in ("e2e_decode_b1_over_inproc", "e2e_agg_8_over_inproc", "e2e_ttft_added_ms"):
        sec[name + "_inputs"] = {"config": "tp1-k0", "prompt": plan.prompt, "decode_tokens": plan.decode_tokens}


def ratios(entry: dict) -> None:
    a, b = entry["inproc"], entry["e2e"]

    def agg(side, n):
        return (side["streams"].get(str(n)) or {}).get("aggregate_tok_s")

    one = (agg(a, 1), agg(b, 1))
    entry["decode_b1_ratio_inputs"] = one
    entry["decode_b1_over_inproc"] = one[1] / one[0] if all(one) else None
    n8 = 8 if "8" in a["streams"] else max(int(n) for n in a["streams"])
    entry["agg_8_over_inproc"] = agg(b, n8) / agg(a, n8) if agg(a, n8) and agg(b, n8) else None
    entry["agg_streams"] = n8
    entry["agg_32_over_inproc"] = agg(b, 32) / agg(a, 32) if agg(a, 32) and agg(b, 32) else None
    entry["ttft_added_ms"] = b["ttft_ms_median"] - a["ttft_ms_median"]
