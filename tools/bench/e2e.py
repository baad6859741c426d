"""End to end: the deployed shape against the in-process engine, in the same run, interleaved.

`ninfer engine` and `ninfer gateway` run as separate processes (as a platform deploys them) and a
gRPC client drives them through the gateway; the in-process side is the `EngineLoop` the same flags
build, warmed up the same way. Both sides are up together and take turns (served, in-process,
served, ...; tools/bench/interleave.py): for each (TP, k), `ttft_samples` prompts alone (the time to
first token; `e2e_ttft_added_ms` is the **median of the paired differences** served - in-process over
at least 32 pairs), then for each stream count `reps` rounds of the streams sent together (1 stream:
`e2e_decode_b1_over_inproc`, 8: `e2e_agg_8_over_inproc`, medians of the per-round ratios). Both sides
are timed by their client alike: TTFT from the call to the first token; a stream's decode rate from
its first to its last token, (tokens - 1) / seconds; the aggregate is the sum over the streams.

Every final message through the gateway is checked against itself and against the client:
    prefill_tok_s = computed_prefill_tokens / prefill_seconds,  prefill_seconds <= ttft_seconds,
    engine TTFT <= gateway TTFT <= the client's TTFT,
    client's first token -> final message >= the engine's decode seconds - (client TTFT - engine TTFT)
(the final message leaves after the engine finished, and the first token reached the client late by at
most the TTFT difference; a rate check with a fixed 5 % slack failed on a loaded machine where the first
token's delivery lagged by a few ms in a 60 ms window). Violations are counted and kept.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from engine.request_stats import RequestStats
from tools.bench import interleave
from tools.bench.progress import say
from tools.bench.session import compact, random_prompt

TOLERANCE = 1e-6          # relative, for identities of floating-point figures
CLOCK_SLACK_S = 1e-3      # two clocks' readings of one interval may differ by this much


@dataclass
class StreamTiming:
    """One request as its client saw it."""

    ttft_s: float | None = None
    first_at: float | None = None
    last_at: float | None = None
    tokens: int = 0
    stats: RequestStats | None = None               # the engine's figures (in the final message)
    gateway_ttft_s: float | None = None             # the gateway's own (e2e only)
    final_at: float | None = None                   # when the final message (with the stats) arrived
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


# -- the two clients --------------------------------------------------------------------------------

def inproc_stream(loop, ids: list[int], params: SamplingParams, timing: StreamTiming) -> None:
    start = time.perf_counter()
    for out in loop.submit(ids, params):
        timing.tokens_arrived(len(out.new_token_ids), time.perf_counter(), start)
        if out.finished:
            timing.stats, timing.final_at = out.stats, time.perf_counter()


def gateway_stream(client, ids: list[int], params: SamplingParams, timing: StreamTiming) -> None:
    from gateway.client import SamplingParams as WireSampling
    from services.convert import stats_from_proto
    wire = WireSampling(max_tokens=params.max_tokens, ignore_eos=params.ignore_eos, temperature=params.temperature)
    start = time.perf_counter()
    for msg in client.generate(prompt_token_ids=ids, sampling=wire, include_token_ids=True):
        timing.tokens_arrived(len(msg.token_ids), time.perf_counter(), start)
        if msg.HasField("result"):
            timing.final_at = time.perf_counter()
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


def ttft_rep(one, vocab: int, plan, served: list | None) -> dict:
    """One prompt alone (two tokens): its client-side TTFT."""
    t = StreamTiming()
    one(random_prompt(plan.prompt, vocab), SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0), t)
    if served is not None:
        served.append(t)
    return {"ttft_ms": t.ttft_s * 1e3 if t.ttft_s is not None else None, "gateway_ttft_s": t.gateway_ttft_s,
            "engine_ttft_s": t.stats.timings.ttft if t.stats else None, "error": t.error}


def streams_rep(one, vocab: int, plan, n: int, timeout: float, served: list | None) -> dict:
    """`n` streams sent together: the sum of their client-side decode rates, and their records."""
    timings = run_together(one, [random_prompt(plan.prompt, vocab) for _ in range(n)],
                           SamplingParams(max_tokens=plan.decode_tokens, ignore_eos=True, temperature=0.0), timeout)
    if served is not None:
        served.extend(timings)
    rates = [t.decode_tok_s for t in timings if t.decode_tok_s]
    return {"aggregate_tok_s": sum(rates) if len(rates) == n else None,
            "per_stream_tok_s_mean": statistics.mean(rates) if rates else None,
            "errors": [t.error for t in timings if t.error],
            "engine_decode_tok_s_mean": statistics.mean([t.stats.rates.decode_tok_s for t in timings if t.stats])
            if any(t.stats for t in timings) else None,
            "records": [{**(compact(t.stats) if t.stats else {}), "client_ttft_s": t.ttft_s,
                         "client_decode_tok_s": t.decode_tok_s, "gateway_ttft_s": t.gateway_ttft_s}
                        for t in timings]}


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
    if t.tokens >= 2 and tm.decode > 0 and t.ttft_s is not None and t.final_at is not None:
        # the client sees the first token late by at most (its TTFT - the engine's), and the final message
        # only after the engine finished: from the one to the other at least the engine's decode less that lag
        window, lag = t.final_at - t.first_at, max(0.0, t.ttft_s - tm.ttft)
        if window < tm.decode - lag - CLOCK_SLACK_S:
            bad.append(f"client's first token to final message {window * 1e3:.2f} ms < the engine's decode "
                       f"{tm.decode * 1e3:.2f} ms less the first token's delivery lag {lag * 1e3:.2f} ms")
    return bad


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
            # the in-process engine stays up: both sides take turns
            with ServerProcess.start("engine", *engine_flags(bench, tp, k, dv), "--log-level", "info",
                                     timeout_s=900) as engine, \
                    ServerProcess.start("gateway", "--engine", engine.address) as gateway, \
                    GatewayClient(gateway.address) as client:
                client.wait_until_serving(900)
                sides = {"served": lambda ids, p, t: gateway_stream(client, ids, p, t),
                         "inproc": lambda ids, p, t: inproc_stream(session.loop, ids, p, t)}
                entry = _interleaved(bench, sides, session.vocab, plan, timeout)
                served = engine.wait_for_event("engine_serving")
            entry.update(label=label, tp=tp, k=k, draft_vocab=dv, prompt=plan.prompt, decode_tokens=plan.decode_tokens,
                         tensor_parallel_size=tp, engine=session.describe,
                         served_engine_warmup={key: served.get(key) for key in
                                               ("cuda_graphs", "graph_buckets", "graph_capture_seconds",
                                                "no_graphs_reason", "warmup_seconds")})
            ratios(entry)
            configs.append(entry)
            say("e2e", f"{label}: TTFT added {entry['ttft_added_ms'] or 0:+.2f} ms (median of {entry['ttft']['reps_paired']} "
                       f"paired differences); decode 1 stream served / in-process {entry['decode_b1_over_inproc'] or 0:.3f}; "
                       f"{entry['consistency_violation_count']} inconsistent of {entry['messages_checked']} final messages")
            bench.save()
    if not any(c.get("label") == "tp1-k0" and "ttft" in c for c in configs):
        sec["e2e_reason"] = "the TP=1, k=0 configuration was not measured"


def _interleaved(bench, sides: dict, vocab: int, plan, timeout: float) -> dict:
    """Warm the served path, then every comparison with the sides taking turns; the served final
    messages are checked."""
    served: list[StreamTiming] = []
    for _ in range(2):                    # the first requests through a new gRPC channel: not measured
        ttft_rep(sides["served"], vocab, plan, None)

    def side_calls(make):
        return {name: (lambda name=name, one=one: make(one, served if name == "served" else None))
                for name, one in sides.items()}

    ttft = interleave.run(side_calls(lambda one, s: ttft_rep(one, vocab, plan, s)), plan.ttft_samples)
    streams = {str(n): interleave.run(side_calls(lambda one, s, n=n: streams_rep(one, vocab, plan, n, timeout, s)),
                                      plan.reps, streams=n)
               for n in plan.streams}
    violations = [v for t in served for v in consistency(t)]
    return {"ttft": ttft, "streams": streams, "consistency_violations": violations[:200],
            "consistency_violation_count": len(violations), "messages_checked": len(served)}


def ratios(entry: dict) -> None:
    """The config's figures by the headline rule (median of per-rep ratios / differences), for the table."""
    ttft = interleave.reduce_pair(entry["ttft"], "served", "inproc", "ttft_ms", op="difference")
    entry["ttft"]["reps_paired"] = ttft["reps"]
    entry["ttft_added_ms"] = ttft["value"]
    entry["ttft_ms_median"] = {side: statistics.median(x for x in interleave.values(entry["ttft"], side, "ttft_ms")
                                                       if x is not None) for side in ("served", "inproc")}
    for n in map(int, entry["streams"]):
        r = interleave.reduce_pair(entry["streams"][str(n)], "served", "inproc", "aggregate_tok_s")
        entry[f"agg_{n}_over_inproc"] = r["value"]
    entry["decode_b1_over_inproc"] = entry.get("agg_1_over_inproc")
