"""A small client of the public Gateway service (the CLI, the tools and the tests use it).

    client = GatewayClient("127.0.0.1:50051")
    client.wait_until_serving(timeout_s=60)
    for msg in client.generate(prompt="Hello", sampling=SamplingParams(max_tokens=32)):
        print(msg.text, end="")                 # the last message has msg.result
"""

from __future__ import annotations

from collections.abc import Iterator

from ninfer.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.engine_client import ServerClient
from services.server.tls import ClientTLS

SamplingParams = common_pb2.SamplingParams


class GatewayClient(ServerClient):
    def __init__(self, target: str, api_key: str | None = None, tls: ClientTLS | None = None):
        super().__init__(target, api_key, tls=tls)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def generate(self, prompt: str | None = None, *, messages: list[tuple[str, str]] | None = None,
                 prompt_token_ids: list[int] | None = None, sampling: common_pb2.SamplingParams | None = None,
                 include_token_ids: bool = False, continuous_usage_stats: bool = False,
                 timeout: float | None = None, model: str = "",
                 parse_special_tokens: bool = False) -> Iterator[gateway_pb2.GenerateResponse]:
        """The response stream (a grpc call: `.cancel()` ends it); raises grpc.RpcError on failure."""
        request = generate_request(prompt, messages, prompt_token_ids, sampling, include_token_ids,
                                   continuous_usage_stats, model)
        request.parse_special_tokens = parse_special_tokens
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)


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
