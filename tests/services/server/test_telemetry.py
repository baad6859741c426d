"""Where spans go: --otlp-endpoint, else the standard OTEL_* variables, else nowhere. A real OTLP/gRPC
receiver on 127.0.0.1 stands in for the collector."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from services.server.telemetry import build_tracer_provider


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request, context):
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[tuple[str, str]]:
        """(service.name, span name) of everything received."""
        out = []
        for req in self.requests:
            for rs in req.resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                out += [(service, s.name) for ss in rs.scope_spans for s in ss.spans]
        return out


@pytest.fixture
def receiver(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SERVICE_NAME",
                 "OTEL_SDK_DISABLED", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)
    r = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(r, server)
    r.endpoint = f"http://127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    yield r
    server.stop(0)


def emit(provider, name: str) -> None:
    provider.get_tracer("test").start_span(name).end()
    provider.force_flush()
    provider.shutdown()


def test_the_flag_sends_spans_over_otlp(receiver):
    emit(build_tracer_provider("ninfer-gateway", receiver.endpoint), "generate")
    assert receiver.spans() == [("ninfer-gateway", "generate")]


def test_the_standard_variables_work_without_the_flag(receiver, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "engine-7")
    emit(build_tracer_provider("ninfer-engine"), "prefill")
    assert receiver.spans() == [("engine-7", "prefill")]


def test_without_an_endpoint_nothing_is_exported(receiver, monkeypatch):
    emit(build_tracer_provider("ninfer-engine"), "decode")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    emit(build_tracer_provider("ninfer-engine"), "decode")
    assert receiver.spans() == []
