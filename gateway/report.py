"""One request's record at the gateway, reported once three ways from the same numbers: the final
stream message, the `generate` span's attributes and the `request_done` log event."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from opentelemetry.trace import Span, Status, StatusCode

from engine.request_stats import RequestStats
from ninfer.v1 import common_pb2, gateway_pb2
from services.server.prometheus import GatewayPrometheus, observe_per_token
from services.server.telemetry import stats_attributes

log = structlog.get_logger(__name__)


@dataclass
class RequestRecord:
    request_id: str
    received: float                                      # monotonic seconds at receipt
    status: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    model: str = ""
    engine: str = ""
    operation: str = ""
    sampling: common_pb2.SamplingParams | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0                           # tokens sent so far
    tokenize_s: float = 0.0
    prefill_call_s: float = 0.0
    migrations: int = 0                                  # times the stream moved to another engine
    first_token_at: float | None = None
    last_token_at: float | None = None
    first_message_sent: bool = False                     # the client has had a message
    stats: RequestStats | None = None                    # the engine's final stats
    result: gateway_pb2.GenerateResult | None = field(default=None, repr=False)

    def token_sent(self, num_tokens: int, metrics: GatewayPrometheus) -> None:
        """Note `num_tokens` handed to the client now (inter-token latency: per token of the message)."""
        if not num_tokens:
            return
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            observe_per_token(metrics.inter_token, now - self.last_token_at, num_tokens)
        self.last_token_at = now
        self.completion_tokens += num_tokens

    def gateway_timings(self) -> gateway_pb2.GatewayTimings:
        first, last = self.first_token_at, self.last_token_at
        return gateway_pb2.GatewayTimings(
            tokenize_seconds=self.tokenize_s, prefill_call_seconds=self.prefill_call_s,
            ttft_seconds=first - self.received if first is not None else 0.0,
            inter_token_seconds=(last - first) / (self.completion_tokens - 1) if self.completion_tokens > 1 else 0.0,
            total_seconds=time.monotonic() - self.received)

    def attributes(self) -> dict[str, Any]:
        """Span attributes = request_done fields (GenAI conventions + ninfer.*). No prompt text."""
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": self.operation or "text_completion",
            "gen_ai.request.model": self.model,
            "gen_ai.response.id": self.request_id,
            "rpc.grpc.status_code": self.status.value[0],
            "ninfer.status": self.status.name,
            "ninfer.engine": self.engine,
            "ninfer.migrations": self.migrations,
            "gen_ai.usage.input_tokens": self.prompt_tokens,
        }
        s = self.sampling
        if s is not None:
            if s.HasField("max_tokens"):
                attrs["gen_ai.request.max_tokens"] = s.max_tokens
            if s.HasField("temperature"):
                attrs["gen_ai.request.temperature"] = s.temperature
            if s.HasField("top_p"):
                attrs["gen_ai.request.top_p"] = s.top_p
            if s.HasField("seed"):
                attrs["gen_ai.request.seed"] = s.seed
        if self.stats is not None:
            attrs.update(stats_attributes(self.stats))
        if self.result is not None:
            g = self.result.gateway_timings
            attrs.update({"ninfer.gateway.tokenize_seconds": g.tokenize_seconds,
                          "ninfer.gateway.prefill_call_seconds": g.prefill_call_seconds,
                          "ninfer.gateway.ttft_seconds": g.ttft_seconds,
                          "ninfer.gateway.inter_token_seconds": g.inter_token_seconds,
                          "ninfer.gateway.total_seconds": g.total_seconds})
        return attrs


def report(record: RequestRecord, span: Span, metrics: GatewayPrometheus) -> None:
    attrs = record.attributes()
    span.set_attributes(attrs)
    if record.status is not grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, record.status.name))
    log.info("request_done", **attrs)
    metrics.requests.labels(status=record.status.name).inc()
    if record.result is not None:
        metrics.ttft.observe(record.result.gateway_timings.ttft_seconds)
        metrics.prompt_tokens.inc(record.prompt_tokens)
        metrics.completion_tokens.inc(record.completion_tokens)
