"""OpenTelemetry: the tracer provider of a process, and span attributes from a request's stats.

Configuration is read when a server starts (never at import): `--otlp-endpoint`, else the standard
OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES variables. Without
an endpoint spans are still made (their context still propagates) but not exported. No prompt text
is ever put on a span.
"""

from __future__ import annotations

import os
from typing import Any

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from engine.request_stats import RequestStats

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def build_tracer_provider(service_name: str, otlp_endpoint: str | None = None) -> TracerProvider:
    """A provider for one process; exports over OTLP/gRPC when an endpoint is configured."""
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return provider
    if otlp_endpoint or any(os.environ.get(v) for v in ENDPOINT_VARIABLES):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        exporter = OTLPSpanExporter(endpoint=otlp_endpoint) if otlp_endpoint else OTLPSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def prefill_attributes(stats: RequestStats) -> dict[str, Any]:
    """What the prefill phase knows: GenAI input usage and ours (ninfer.*)."""
    u, t = stats.usage, stats.timings
    return {
        "gen_ai.usage.input_tokens": u.prompt_tokens,
        "ninfer.computed_prefill_tokens": u.computed_prefill_tokens,
        "ninfer.cached_tokens": u.cached_tokens,
        "ninfer.prefill_chunk": stats.prefill_chunk,
        "ninfer.queue_seconds": t.queue,
        "ninfer.prefill_seconds": t.prefill,
        "ninfer.ttft_seconds": t.ttft,
        "ninfer.prefill_tok_s": stats.rates.prefill_tok_s,
    }


def stats_attributes(stats: RequestStats) -> dict[str, Any]:
    """A finished request's stats as flat span attributes. The same dict is logged as `request_done`,
    so that span and log agree by construction."""
    t, spec = stats.timings, stats.speculative
    return {
        **prefill_attributes(stats),
        "gen_ai.usage.output_tokens": stats.usage.completion_tokens,
        "gen_ai.response.finish_reasons": (stats.finish_reason.value if stats.finish_reason else "",),
        "ninfer.preemptions": stats.preemptions,
        "ninfer.decode_seconds": t.decode,
        "ninfer.total_seconds": t.total,
        "ninfer.decode_tok_s": stats.rates.decode_tok_s,
        "ninfer.draft_tokens": spec.draft_tokens,
        "ninfer.speculative_rounds": spec.rounds,
        "ninfer.drafted_tokens": spec.drafted,
        "ninfer.accepted_tokens": spec.accepted,
        "ninfer.accepted_per_position": spec.accepted_per_position,
    }
