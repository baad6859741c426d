"""Traces, logs and metrics of one request through a real gateway and engine on 127.0.0.1.

The gateway and the engine get separate tracer providers, each with the SDK's InMemorySpanExporter:
an engine span can only find its gateway parent through the W3C traceparent sent over the socket.
"""

from __future__ import annotations

import io
import json
import time
import urllib.request

import pytest
import structlog
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from engine.config import EngineConfig
from gateway.client import GatewayClient, SamplingParams
from ninfer.cli.logs import configure_logging
from gateway.serve import ServeStack
from services.convert import stats_from_proto
from services.server.grpc_server import ServerOptions
from services.server.telemetry import stats_attributes

PROMPT = "my secret prompt text"
LOG_META = {"event", "level", "timestamp", "request_id"}


def traced_provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


@pytest.fixture(scope="module")
def run():
    """One request; returns (final message, gateway spans, engine spans, log events, stack)."""
    gateway_tp, gateway_spans = traced_provider()
    engine_tp, engine_spans = traced_provider()
    logs = io.StringIO()
    configure_logging(json_logs=True, level="info", stream=logs)
    stack = ServeStack(EngineConfig(kv_capacity=4096, draft_tokens=2),
                       ServerOptions(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", tracer_provider=gateway_tp),
                       engine_options=ServerOptions(listen="127.0.0.1:0", tracer_provider=engine_tp)).start()
    try:
        with GatewayClient(stack.address) as client:
            client.wait_until_serving(timeout_s=60)
            *_, final = client.generate(PROMPT, sampling=SamplingParams(max_tokens=10, ignore_eos=True,
                                                                        temperature=0.5, seed=3))
        deadline = time.monotonic() + 30          # the server spans end just after the last message
        while len(gateway_spans.get_finished_spans()) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        events = [json.loads(line) for line in logs.getvalue().splitlines() if line.startswith("{")]
        yield final, gateway_spans.get_finished_spans(), engine_spans.get_finished_spans(), events, stack
    finally:
        stack.stop()
        structlog.reset_defaults()


def one(spans, name: str, kind: SpanKind):
    (span,) = [s for s in spans if s.name == name and s.kind == kind]
    return span


def test_span_names_and_parents_across_the_process_boundary(run):
    final, gw, en, _, _ = run
    server = one(gw, "/ninfer.v1.Gateway/Generate", SpanKind.SERVER)
    generate = one(gw, "generate", SpanKind.INTERNAL)
    prefill_call = one(gw, "/ninfer.v1.PrefillService/Prefill", SpanKind.CLIENT)
    decode_call = one(gw, "/ninfer.v1.DecodeService/Decode", SpanKind.CLIENT)
    assert generate.parent.span_id == server.context.span_id
    assert prefill_call.parent.span_id == decode_call.parent.span_id == generate.context.span_id
    prefill_server = one(en, "/ninfer.v1.PrefillService/Prefill", SpanKind.SERVER)
    decode_server = one(en, "/ninfer.v1.DecodeService/Decode", SpanKind.SERVER)
    assert prefill_server.parent.span_id == prefill_call.context.span_id and prefill_server.parent.is_remote
    assert decode_server.parent.span_id == decode_call.context.span_id and decode_server.parent.is_remote
    assert one(en, "prefill", SpanKind.INTERNAL).parent.span_id == prefill_server.context.span_id
    assert one(en, "decode", SpanKind.INTERNAL).parent.span_id == decode_server.context.span_id
    assert {s.context.trace_id for s in (*gw, *en)} == {server.context.trace_id}, "one trace per request"
    assert not [s.name for s in (*gw, *en) if "grpc.health" in s.name], "health probes are not traced"
    assert generate.attributes["gen_ai.response.id"] == final.request_id


def test_generate_attributes_equal_request_done_and_the_final_message(run):
    final, gw, _, events, _ = run
    attrs = dict(one(gw, "generate", SpanKind.INTERNAL).attributes)
    (done,) = [e for e in events if e["event"] == "request_done"]
    assert done["request_id"] == final.request_id
    logged = {k: v for k, v in done.items() if k not in LOG_META}
    assert logged == {k: list(v) if isinstance(v, tuple) else v for k, v in attrs.items()}
    r = final.result
    s, t = r.stats, r.stats.timings
    expected = {
        "gen_ai.request.model": r.model, "gen_ai.usage.input_tokens": s.usage.prompt_tokens,
        "gen_ai.usage.output_tokens": s.usage.completion_tokens, "ninfer.cached_tokens": s.usage.cached_tokens,
        "ninfer.computed_prefill_tokens": s.usage.computed_prefill_tokens, "ninfer.prefill_chunk": s.prefill_chunk,
        "ninfer.queue_seconds": t.queue_seconds, "ninfer.prefill_seconds": t.prefill_seconds,
        "ninfer.decode_seconds": t.decode_seconds, "ninfer.ttft_seconds": t.ttft_seconds,
        "ninfer.prefill_tok_s": s.rates.prefill_tok_s, "ninfer.decode_tok_s": s.rates.decode_tok_s,
        "ninfer.draft_tokens": s.speculative.draft_tokens, "ninfer.speculative_rounds": s.speculative.rounds,
        "ninfer.accepted_per_position": tuple(s.speculative.accepted_per_position),
        "ninfer.gateway.ttft_seconds": r.gateway_timings.ttft_seconds,
        "ninfer.gateway.inter_token_seconds": r.gateway_timings.inter_token_seconds,
        "ninfer.gateway.total_seconds": r.gateway_timings.total_seconds,
        "ninfer.engine": r.engine, "ninfer.status": "OK", "gen_ai.request.temperature": 0.5,
    }
    assert {k: attrs[k] for k in expected} == expected
    assert s.usage.completion_tokens == 10 and s.speculative.draft_tokens == 2 and s.speculative.rounds > 0


def test_engine_spans_carry_the_engine_stats(run):
    final, _, en, events, _ = run
    stats = stats_from_proto(final.result.stats)
    decode = dict(one(en, "decode", SpanKind.INTERNAL).attributes)
    assert decode == {"ninfer.request_id": final.request_id, **stats_attributes(stats)}
    prefill = one(en, "prefill", SpanKind.INTERNAL).attributes
    assert prefill["ninfer.queue_seconds"] == stats.timings.queue
    assert prefill["ninfer.computed_prefill_tokens"] == stats.usage.computed_prefill_tokens
    (engine_done,) = [e for e in events if e["event"] == "engine_request_done"]
    assert engine_done["request_id"] == final.request_id, "the request id is bound in the engine's logs too"


def test_no_prompt_text_on_any_span(run):
    _, gw, en, _, _ = run
    for span in (*gw, *en):
        for value in span.attributes.values():
            assert "secret" not in str(value), span.name


def test_prometheus_metrics_on_the_serve_endpoint(run):
    final, _, _, _, stack = run
    text = urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=10).read().decode()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    usage = final.result.stats.usage
    assert samples['ninfer_gateway_requests_total{status="OK"}'] == 1
    assert samples["ninfer_gateway_time_to_first_token_seconds_count"] == 1
    assert samples["ninfer_gateway_inter_token_latency_seconds_count"] == usage.completion_tokens - 1
    assert samples["ninfer_engine_time_to_first_token_seconds_count"] == 1
    assert samples["ninfer_engine_queue_wait_seconds_count"] == 1
    assert samples["ninfer_engine_prefill_tokens_total"] == usage.computed_prefill_tokens
    assert samples["ninfer_engine_generated_tokens_total"] == usage.completion_tokens
    assert samples["ninfer_engine_spec_rounds_total"] == final.result.stats.speculative.rounds
    for position, accepted in enumerate(final.result.stats.speculative.accepted_per_position, start=1):
        assert samples[f'ninfer_engine_spec_accepted_tokens_total{{position="{position}"}}'] == accepted
    assert samples["ninfer_engine_queue_length"] == 0 and samples["ninfer_engine_kv_cache_usage_ratio"] == 0
    assert samples[f'ninfer_gateway_engine_in_flight{{engine="{stack.engine.address}"}}'] == 0
