"""Optional bearer-token check for every rpc but health and reflection (probes need no secret)."""

from __future__ import annotations

import hmac

import grpc

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def bearer_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata that presents `api_key` (none when there is no key)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """UNAUTHENTICATED unless the call carries `authorization: Bearer <api key>` (constant-time compare)."""

    def __init__(self, api_key: str):
        self._expected = f"Bearer {api_key}".encode()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(EXEMPT_PREFIXES):
            return handler
        presented = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(presented.encode(), self._expected):
            return handler
        return _denied(handler)


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    def deny(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token (metadata 'authorization')")

    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            deny, handler.request_deserializer, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)
