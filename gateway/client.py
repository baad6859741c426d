"""A small client of the public Gateway service (the CLI, the tools and the tests use it).

    client = GatewayClient("127.0.0.1:50051")
    client.wait_until_serving(timeout_s=60)
    for msg in client.generate(prompt="Hello", sampling=SamplingParams(max_tokens=32)):
        print(msg.text, end="")                 # the last message has msg.result
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ninfer.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.auth import bearer_metadata

SamplingParams = common_pb2.SamplingParams


class GatewayClient:
    def __init__(self, target: str, api_key: str | None = None):
        self.target = target
        self.channel = grpc.insecure_channel(target)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.metadata = bearer_metadata(api_key)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "GatewayClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompt: str | None = None, *, messages: list[tuple[str, str]] | None = None,
                 prompt_token_ids: list[int] | None = None, sampling: common_pb2.SamplingParams | None = None,
                 include_token_ids: bool = False, continuous_usage_stats: bool = False,
                 timeout: float | None = None, model: str = "") -> Iterator[gateway_pb2.GenerateResponse]:
        """The response stream (a grpc call: `.cancel()` ends it); raises grpc.RpcError on failure."""
        return self.stub.Generate(
            generate_request(prompt, messages, prompt_token_ids, sampling, include_token_ids,
                             continuous_usage_stats, model),
            timeout=timeout, metadata=self.metadata)

    def serving_status(self, timeout: float = 2.0) -> int:
        return self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout).status

    def wait_until_serving(self, timeout_s: float, poll_s: float = 0.2) -> None:
        """Block until the gateway's health says SERVING; TimeoutError after `timeout_s`."""
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


def generate_request(prompt: str | None = None, messages: list[tuple[str, str]] | None = None,
                     prompt_token_ids: list[int] | None = None, sampling: common_pb2.SamplingParams | None = None,
                     include_token_ids: bool = False, continuous_usage_stats: bool = False,
                     model: str = "") -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(
        sampling=sampling or SamplingParams(), model=model,
        stream_options=gateway_pb2.StreamOptions(include_token_ids=include_token_ids,
                                                 continuous_usage_stats=continuous_usage_stats))
    if messages is not None:
        req.messages.messages.extend(gateway_pb2.ChatMessage(role=r, content=c) for r, c in messages)
    elif prompt_token_ids is not None:
        req.prompt_token_ids.ids.extend(prompt_token_ids)
    elif prompt is not None:
        req.prompt = prompt
    return req
