"""Clients of ninfer servers: the engine's services (for tools and tests that talk to an engine
directly; the gateway's overhead is measured against this path) and what every server shares
(health, a bearer token). The gateway's client is gateway.client.GatewayClient."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ninfer.v1 import (common_pb2, decode_pb2, decode_pb2_grpc, engine_info_pb2, engine_info_pb2_grpc, prefill_pb2,
                       prefill_pb2_grpc)
from services.server.auth import bearer_metadata
from services.server.tls import ClientTLS, open_channel


class ServerClient:
    """A channel to one ninfer server, its health, and the metadata that carries the bearer token."""

    def __init__(self, target: str, api_key: str | None = None, options: list[tuple[str, int]] | None = None,
                 tls: ClientTLS | None = None):
        """`tls`: call over TLS (its CA; its certificate and key for mutual TLS); None: plaintext."""
        self.target = target
        self.channel = open_channel(target, tls, options=options)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.metadata = bearer_metadata(api_key)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def serving_status(self, timeout: float = 2.0) -> int:
        return self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout).status

    def wait_until_serving(self, timeout_s: float, poll_s: float = 0.2) -> None:
        """Block until health says SERVING; TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                status = self.serving_status(timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.RpcError as e:
                last = f"{e.code().name}: {e.details()}"
            time.sleep(poll_s)
        raise TimeoutError(f"{self.target} is not SERVING after {timeout_s:g} s (last: {last})")


class EngineClient(ServerClient):
    def __init__(self, target: str, api_key: str | None = None, tls: ClientTLS | None = None):
        super().__init__(target, api_key, options=[("grpc.max_receive_message_length", -1)], tls=tls)   # the tokenizer
        self.prefill_stub = prefill_pb2_grpc.PrefillServiceStub(self.channel)
        self.decode_stub = decode_pb2_grpc.DecodeServiceStub(self.channel)
        self.info_stub = engine_info_pb2_grpc.EngineInfoServiceStub(self.channel)

    def prefill(self, prompt_token_ids: list[int], sampling: common_pb2.SamplingParams | None = None,
                request_id: str = "", timeout: float | None = None) -> prefill_pb2.PrefillResponse:
        return self.prefill_stub.Prefill(
            prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                       sampling=sampling or common_pb2.SamplingParams()),
            timeout=timeout, metadata=self.metadata)

    def decode(self, handle: str, timeout: float | None = None) -> Iterator[decode_pb2.DecodeResponse]:
        return self.decode_stub.Decode(decode_pb2.DecodeRequest(handle=handle), timeout=timeout,
                                       metadata=self.metadata)

    def release(self, handle: str) -> None:
        self.prefill_stub.Release(prefill_pb2.ReleaseRequest(handle=handle), metadata=self.metadata)

    def metrics(self) -> engine_info_pb2.EngineMetrics:
        return self.info_stub.GetMetrics(engine_info_pb2.GetMetricsRequest(), metadata=self.metadata)

    def model_info(self) -> engine_info_pb2.ModelInfo:
        return self.info_stub.GetModelInfo(engine_info_pb2.GetModelInfoRequest(), metadata=self.metadata)

    def wait_idle(self, timeout_s: float = 30.0, poll_s: float = 0.02) -> engine_info_pb2.EngineMetrics:
        """Metrics once no request is queued, prefilling, running or parked and the runner has dropped the
        hidden-state rows of those that left (a step after them) (or after `timeout_s`: the caller asserts
        on what it gets)."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            q, held = m.queue, m.kv
            busy = q.waiting or q.prefilling or q.running or q.parked or held.mtp_hidden_rows_used
            if not busy or time.monotonic() > deadline:
                return m
            time.sleep(poll_s)
