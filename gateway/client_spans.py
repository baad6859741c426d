"""Client spans of the gateway's calls to engines, made here rather than by the grpc instrumentation.

opentelemetry-instrumentation-grpc's asyncio client interceptors wait for the call's status inside
the interceptor: a cancelled caller cancels that wait but not the call, so the engine never learns
that the client left (a prefilled handle then waits for its lease). The spans are the ones the
instrumentation makes (name `/service/method`, kind CLIENT, rpc.* attributes, the status code); the
W3C traceparent goes in the call's metadata.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from opentelemetry.propagate import inject
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer


@contextmanager
def client_span(tracer: Tracer, service: str, method: str) -> Iterator[tuple[Span, tuple[tuple[str, str], ...]]]:
    """(span, metadata carrying its context) around one engine call; an RpcError sets its status."""
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method,
                  "rpc.grpc.status_code": grpc.StatusCode.OK.value[0]}
    with tracer.start_as_current_span(f"/{service}/{method}", kind=SpanKind.CLIENT, attributes=attributes,
                                      record_exception=False, set_status_on_exception=False) as span:
        carrier: dict[str, str] = {}
        inject(carrier)
        try:
            yield span, tuple(carrier.items())
        except grpc.RpcError as e:
            span.set_attribute("rpc.grpc.status_code", e.code().value[0])
            span.set_status(Status(StatusCode.ERROR, e.code().name))
            raise
