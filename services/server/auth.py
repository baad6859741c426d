"""Optional bearer-token check for every rpc but health and reflection (probes need no secret)."""

from __future__ import annotations

import hmac

import grpc

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
DENIED = "missing or invalid bearer token (metadata 'authorization')"


def bearer_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata that presents `api_key` (none when there is no key)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless the call carries `authorization: Bearer <api key>` (constant-time compare)."""

    def __init__(self, api_key: str):
        self._expected = f"Bearer {api_key}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(EXEMPT_PREFIXES):
            return handler
        presented = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if isinstance(presented, bytes):
            presented = presented.decode("latin-1")
        if hmac.compare_digest(presented.encode(), self._expected):
            return handler
        return _denied(handler)


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)
        yield  # pragma: no cover - an async generator that ends at the abort

    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            deny_stream, handler.request_deserializer, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)
