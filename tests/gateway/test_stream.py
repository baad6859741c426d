"""Streams through a real gateway and engine on 127.0.0.1 (`ninfer serve`'s stack): the same tokens
and text as LLM.generate, stop strings, the three prompt inputs, stream options, the final result."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine import LLM
from engine.config import EngineConfig
from gateway.client import GatewayClient, SamplingParams
from gateway.serve import ServeStack
from ninfer.v1 import common_pb2, gateway_pb2
from services.convert import sampling_from_proto, stats_from_proto
from services.server.grpc_server import ServerOptions

KV = 4096


def start_stack(model: str | None = None, **engine_args) -> ServeStack:
    return ServeStack(EngineConfig(model=model, kv_capacity=KV, dtype="float32", **engine_args),
                      ServerOptions(listen="127.0.0.1:0")).start()


@pytest.fixture(scope="module")
def stack():
    s = start_stack()
    yield s
    s.stop()


def collect(messages) -> tuple[str, list[int], object]:
    """(text, token ids, last message) of a whole stream."""
    text, ids, last = "", [], None
    for last in messages:
        text += last.text
        ids += list(last.token_ids)
    return text, ids, last


CASES = [SamplingParams(max_tokens=20), SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7),
         SamplingParams(max_tokens=20, temperature=1.0, top_k=20, seed=11, ignore_eos=True)]


def assert_matches_llm_generate(client: GatewayClient, llm: LLM, prompts: list[str]) -> None:
    for prompt in prompts:
        for sampling in CASES:
            (ref,) = llm.generate(prompt, sampling_from_proto(sampling))       # one at a time: batch-1 numerics
            text, ids, last = collect(client.generate(prompt, sampling=sampling, include_token_ids=True))
            assert ids == ref.token_ids, (prompt, sampling)
            assert text == ref.text, (prompt, sampling)
            assert stats_from_proto(last.result.stats).finish_reason == ref.finish_reason


def test_stream_equals_llm_generate_embedded_model(client):
    assert_matches_llm_generate(client, LLM(kv_capacity=KV, dtype="float32"),
                                ["The quick brown fox", "Hello, wörld 世界"])


def test_stream_equals_llm_generate_shared_model_with_mtp(shared_model):
    stack = start_stack(shared_model, draft_tokens=2)
    try:
        with GatewayClient(stack.address) as c:
            c.wait_until_serving(timeout_s=60)
            llm = LLM(shared_model, kv_capacity=KV, dtype="float32", draft_tokens=2)
            assert_matches_llm_generate(c, llm, ["def fibonacci(n):\n    if n < 2:", "A fortune for today:"])
            *_, last = c.generate("1. item 1\n2. item 2\n3.", sampling=SamplingParams(max_tokens=24, ignore_eos=True))
            spec = last.result.stats.speculative
            assert spec.draft_tokens == 2 and spec.rounds > 0 and len(spec.accepted_per_position) == 2
            assert spec.accepted > 0, "the trained MTP head accepts drafts on an enumeration"
    finally:
        stack.stop()


def test_the_final_message_carries_usage_timings_rates_and_gateway_timings(client, stack):
    text, _, last = collect(client.generate("Tell me", sampling=SamplingParams(max_tokens=12, ignore_eos=True)))
    r = last.result
    u, t, rates = r.stats.usage, r.stats.timings, r.stats.rates
    assert last.usage == u and u.prompt_tokens == 7 and u.completion_tokens == 12
    assert u.computed_prefill_tokens + u.cached_tokens == u.prompt_tokens
    assert rates.decode_tok_s == pytest.approx((u.completion_tokens - 1) / t.decode_seconds)
    assert rates.prefill_tok_s == pytest.approx(u.computed_prefill_tokens / t.prefill_seconds)
    assert t.total_seconds >= t.ttft_seconds > 0 and r.stats.prefill_chunk == 2048
    assert r.model == "ninfer-embedded-tiny" and r.engine == stack.engine.address
    g = r.gateway_timings
    assert g.total_seconds >= g.ttft_seconds >= g.prefill_call_seconds > 0 and g.inter_token_seconds > 0
    assert g.ttft_seconds >= t.ttft_seconds, "the gateway's time to first token contains the engine's"
    assert last.request_id and len(text) > 0


def test_a_stop_string_ends_the_text_before_it(client):
    sampling = SamplingParams(max_tokens=30, ignore_eos=True)
    full, _, _ = collect(client.generate("Once upon", sampling=sampling))
    stop = full[10:12]
    expected = full[:full.index(stop)]
    sampling.stop.append(stop)
    deltas = [m.text for m in client.generate("Once upon", sampling=sampling)]
    assert "".join(deltas) == expected
    *_, last = client.generate("Once upon", sampling=sampling)
    assert last.result.stats.finish_reason == common_pb2.FINISH_REASON_STOP
    assert last.result.stats.usage.completion_tokens < 30


def test_chat_messages_and_token_ids_are_prompts_too(client, stack):
    tokenizer = stack.engine.loop.core.tokenizer
    messages = [("system", "Be brief."), ("user", "Hi")]
    sampling = SamplingParams(max_tokens=5)
    chat_text, chat_ids, chat_last = collect(client.generate(messages=messages, sampling=sampling,
                                                             include_token_ids=True))
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
    assert chat_last.result.stats.usage.prompt_tokens == len(ids)
    text, token_ids, _ = collect(client.generate(prompt_token_ids=ids, sampling=sampling, include_token_ids=True))
    assert (text, token_ids) == (chat_text, chat_ids)


def test_stream_options(client):
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    plain = list(client.generate("abc", sampling=sampling))
    assert all(not m.token_ids for m in plain) and all(not m.HasField("usage") for m in plain[:-1])
    counted = list(client.generate("abc", sampling=sampling, include_token_ids=True, continuous_usage_stats=True))
    running = [m.usage.completion_tokens for m in counted]
    assert running == sorted(running) and running[-1] == 6
    assert [len(m.token_ids) for m in counted] and sum(len(m.token_ids) for m in counted) == 6


def test_get_engine_metrics_through_the_gateway(client, stack):
    list(client.generate("metrics", sampling=SamplingParams(max_tokens=3)))
    (entry,) = client.stub.GetEngineMetrics(gateway_pb2.GetEngineMetricsRequest()).engines
    assert entry.engine == stack.engine.address and entry.serving and entry.in_flight == 0
    assert entry.metrics.kv.num_blocks == KV // 16 and sum(entry.metrics.history.prefill_tokens) > 0
    assert entry.metrics.performance.requests["length"] >= 1


def test_ninfer_generate_streams_from_the_gateway(stack):
    out = subprocess.run([sys.executable, "-m", "ninfer", "generate", "--gateway", stack.address, "--prompt",
                          "Hi there", "--max-tokens", "5", "--ignore-eos", "--json", "--wait-ready", "30"],
                         capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    *deltas, final = [json.loads(line) for line in out]
    assert sum(len(d["token_ids"]) for d in deltas) == 5 == final["stats"]["usage"]["completion_tokens"]
    assert final["finish_reason"] == "length" and final["model"] == "ninfer-embedded-tiny"
    assert set(final["stats"]) >= {"usage", "timings", "rates", "speculative"}
    assert final["gateway_timings"]["ttft"] > 0


def test_every_final_message_agrees_with_itself_and_the_client_under_concurrency(client):
    """8 streams at once, the same 200-token prompt twice over (the second wave finds it in the prefix
    cache): every final message satisfies the bench's identities (tools/bench/e2e.py `consistency`),
    and a prefill rate counts only the tokens its prefill computed -- the cause of a 397 tok/s
    'prefill rate' for a 512-token prompt (496 of its tokens were cached; 16 computed in one step)."""
    from tools.bench.e2e import StreamTiming, consistency, gateway_stream, run_together
    from engine.sampling_params import SamplingParams as EngineSampling

    prompt = [(7 * i) % 300 + 3 for i in range(200)]
    params = EngineSampling(max_tokens=6, ignore_eos=True, temperature=0.0)
    waves = [run_together(lambda ids, p, t: gateway_stream(client, ids, p, t), [prompt] * 8, params, 120)
             for _ in range(2)]
    timings: list[StreamTiming] = [t for wave in waves for t in wave]
    assert [v for t in timings for v in consistency(t)] == []
    for t in timings:
        u = t.stats.usage
        assert u.computed_prefill_tokens + u.cached_tokens == u.prompt_tokens == 200
        assert t.stats.rates.prefill_tok_s == pytest.approx(u.computed_prefill_tokens / t.stats.timings.prefill)
    assert any(t.stats.usage.cached_tokens >= 192 for t in waves[1]), "the second wave reuses the cached prefix"


def test_the_consistency_check_catches_what_cannot_be_true():
    from dataclasses import replace

    from engine.request_stats import Rates, RequestStats, SpeculativeCounts, Timings, Usage
    from tools.bench.e2e import StreamTiming, consistency

    good = RequestStats(Usage(512, 16, 496, 5), Timings(0.001, 0.04, 0.02, 0.061, 0.041), Rates(400.0, 200.0),
                        SpeculativeCounts(0, 0, 0, 0, ()), 2048, 0, None)
    t = StreamTiming(ttft_s=0.05, first_at=1.0, last_at=1.03, tokens=5, stats=good, gateway_ttft_s=0.045, final_at=1.031)
    assert consistency(t) == []
    assert consistency(replace(t, stats=replace(good, usage=replace(good.usage, computed_prefill_tokens=512))))
    assert consistency(replace(t, stats=replace(good, timings=replace(good.timings, prefill=0.05))))
    assert consistency(replace(t, gateway_ttft_s=0.06))                  # gateway later than its client
    assert consistency(replace(t, gateway_ttft_s=0.03))                  # engine later than its gateway
    assert consistency(replace(t, tokens=4))
    # the final message came 5 ms after the first token, though the engine says it decoded for 20 ms and the
    # first token reached the client at most 9 ms late (its TTFT 50 ms, the engine's 41 ms)
    assert consistency(replace(t, last_at=1.004, final_at=1.005))
    # the first token delivered 5 ms late and the rest on time: the client's rate beats the engine's
    # (4 / 15 ms), which is no contradiction -- its TTFT shows the lag
    late = replace(t, ttft_s=0.055, first_at=1.005, last_at=1.02, final_at=1.021, gateway_ttft_s=0.05)
    assert late.decode_tok_s > 1.05 * good.rates.decode_tok_s and consistency(late) == []
