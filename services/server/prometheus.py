"""Prometheus metrics of an engine process and of a gateway, each on its own registry, over HTTP.

Rates and phase times come from each request's own stats (as everywhere in ninfer); queue and KV
state are read from the engine snapshot when Prometheus scrapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.request_stats import RequestStats
from services.server.address import split_host_port

# Seconds; dense below 100 ms, where CPU tests and GPU decode steps live.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 30.0)


def observe_per_token(histogram: Histogram, seconds: float, num_tokens: int) -> None:
    """`num_tokens` arrived together after `seconds`: each token waited seconds / num_tokens."""
    for _ in range(num_tokens):
        histogram.observe(seconds / num_tokens)


def serve_metrics(listen: str, registry: CollectorRegistry):
    """Start the /metrics HTTP endpoint; returns (server, port). The caller shuts it down."""
    host, port = split_host_port(listen)
    try:
        server, _ = start_http_server(port, host, registry=registry)
    except OSError as e:
        raise OSError(f"cannot serve metrics on {listen} (--metrics-listen): {e.strerror or e}") from None
    return server, server.server_port


class EnginePrometheus:
    """ninfer_engine_* metrics: fed by the services per request, plus a snapshot collector."""

    def __init__(self, registry: CollectorRegistry, snapshot: Callable[[], dict[str, Any] | None]):
        r = registry
        self.ttft = Histogram("ninfer_engine_time_to_first_token_seconds",
                              "Arrival to first token, per request (engine clock)", buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("ninfer_engine_inter_token_latency_seconds",
                                     "Seconds per token between decode messages", buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("ninfer_engine_queue_wait_seconds", "FIFO wait before the prefill lane",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_tokens = Counter("ninfer_engine_prefill_tokens", "Prompt tokens computed by prefill", registry=r)
        self.cached_tokens = Counter("ninfer_engine_cached_prompt_tokens", "Prompt tokens from the prefix cache",
                                     registry=r)
        self.generated_tokens = Counter("ninfer_engine_generated_tokens", "Tokens generated", registry=r)
        self.spec_rounds = Counter("ninfer_engine_spec_rounds", "Speculative draft+verify rounds", registry=r)
        self.accepted = Counter("ninfer_engine_spec_accepted_tokens", "Accepted draft tokens by draft position",
                                ["position"], registry=r)
        r.register(_EngineSnapshotCollector(snapshot))

    def observe_prefill(self, stats: RequestStats) -> None:
        self.ttft.observe(stats.timings.ttft)
        self.queue_wait.observe(stats.timings.queue)
        self.prefill_tokens.inc(stats.usage.computed_prefill_tokens)
        self.cached_tokens.inc(stats.usage.cached_tokens)

    def observe_finished(self, stats: RequestStats) -> None:
        spec = stats.speculative
        self.generated_tokens.inc(stats.usage.completion_tokens)
        self.spec_rounds.inc(spec.rounds)
        for i, n in enumerate(spec.accepted_per_position):
            self.accepted.labels(position=str(i + 1)).inc(n)


class _EngineSnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any] | None]):
        self._snapshot = snapshot

    def collect(self):
        snap = self._snapshot()
        if snap is None:                       # the engine is not loaded (yet)
            return
        q, kv = snap["queue"], snap["kv"]
        yield GaugeMetricFamily("ninfer_engine_queue_length", "Requests waiting in the FIFO queue",
                                value=q["waiting"])
        requests = GaugeMetricFamily("ninfer_engine_requests", "Requests by state", labels=["state"])
        for state in ("prefilling", "running", "parked", "awaiting_seat"):
            requests.add_metric([state], q.get(state, 0))
        yield requests
        oldest = GaugeMetricFamily("ninfer_engine_oldest_wait_seconds", "The longest wait now: a parked handle "
                                   "for its decode, an attached request for a decode seat", labels=["state"])
        oldest.add_metric(["parked"], q.get("oldest_parked_s", 0.0))
        oldest.add_metric(["awaiting_seat"], q.get("oldest_awaiting_seat_s", 0.0))
        yield oldest
        yield GaugeMetricFamily("ninfer_engine_kv_cache_usage_ratio", "Share of KV blocks in use", value=kv["usage"])
        yield GaugeMetricFamily("ninfer_engine_kv_free_blocks", "KV blocks free", value=kv["free_blocks"])
        if "state_slots" in kv:                       # hybrid models
            slots = GaugeMetricFamily("ninfer_engine_state_slots", "Linear-attention state slots (hybrid models)",
                                      labels=["state"])
            slots.add_metric(["used"], kv["state_slots_used"])
            slots.add_metric(["free"], kv["state_slots"] - kv["state_slots_used"])
            yield slots
        finished = CounterMetricFamily("ninfer_engine_requests_finished", "Finished requests by finish reason",
                                       labels=["finish_reason"])
        for reason, n in sorted(snap["performance"]["requests"].items()):
            finished.add_metric([reason], n)
        yield finished


class GatewayPrometheus:
    """ninfer_gateway_* metrics, as the client sees them."""

    def __init__(self, registry: CollectorRegistry, engines: Callable[[], list[tuple[str, bool, int]]]):
        r = registry
        self.ttft = Histogram("ninfer_gateway_time_to_first_token_seconds", "Receipt to first token sent",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("ninfer_gateway_inter_token_latency_seconds",
                                     "Seconds per token between streamed messages", buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("ninfer_gateway_requests", "Generate calls by final gRPC status", ["status"],
                                registry=r)
        self.prompt_tokens = Counter("ninfer_gateway_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("ninfer_gateway_completion_tokens", "Tokens streamed", registry=r)
        self.migrations = Counter("ninfer_gateway_stream_migrations", "Streams resumed on another engine, by why "
                                  "their engine was lost", ["reason"], registry=r)
        r.register(_EnginePoolCollector(engines))


class _EnginePoolCollector(Collector):
    def __init__(self, engines: Callable[[], list[tuple[str, bool, int]]]):
        self._engines = engines

    def collect(self):
        serving = GaugeMetricFamily("ninfer_gateway_engine_serving", "1 when the engine takes requests",
                                    labels=["engine"])
        in_flight = GaugeMetricFamily("ninfer_gateway_engine_in_flight", "Requests in flight per engine",
                                      labels=["engine"])
        for address, up, n in self._engines():
            serving.add_metric([address], int(up))
            in_flight.add_metric([address], n)
        yield serving
        yield in_flight
