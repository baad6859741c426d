"""Bad inputs through the gateway: each gets its status and a message naming the field and limit,
nothing is enqueued, and the server keeps serving. Also authentication."""

from __future__ import annotations

import math

import grpc
import pytest

from engine.config import EngineConfig
from gateway.client import GatewayClient, SamplingParams
from gateway.serve import ServeStack
from services.engine_client import EngineClient
from services.server.errors import RETRY_PUSHBACK_KEY
from services.server.grpc_server import ServerOptions

KV = 2048                     # below the embedded model's 4096-token context: both limits can be hit
MAX_MESSAGE_BYTES = 64 * 1024
PUSHBACK_MS = 700


@pytest.fixture(scope="module")
def stack():
    s = ServeStack(EngineConfig(kv_capacity=KV),
                   ServerOptions(listen="127.0.0.1:0", max_message_bytes=MAX_MESSAGE_BYTES,
                                 retry_pushback_ms=PUSHBACK_MS)).start()
    yield s
    s.stop()


def failure(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        list(call())
    return e.value


def assert_still_serving(client: GatewayClient, stack: ServeStack) -> None:
    *_, last = client.generate("ok", sampling=SamplingParams(max_tokens=2))
    assert last.result.stats.usage.completion_tokens >= 1
    with EngineClient(stack.engine.address, stack.engine_api_key) as engine:
        m = engine.wait_idle()
        assert m.kv.free_blocks == m.kv.num_blocks and m.kv.refs_taken == m.kv.refs_dropped


BAD_SAMPLING = [
    ("temperature", dict(temperature=-0.5), "temperature: must be a finite number >= 0"),
    ("temperature", dict(temperature=math.nan), "temperature: must be a finite number >= 0"),
    ("top_p", dict(top_p=0.0), "top_p: must be in (0, 1]"),
    ("top_p", dict(top_p=1.5), "top_p: must be in (0, 1]"),
    ("top_k", dict(top_k=-2), "top_k: must be an integer >= 0 (0 or -1 = off)"),
    ("max_tokens", dict(max_tokens=0), "max_tokens: must be >= 1 (0 only scores the prompt"),
    ("seed", dict(seed=2**63), "seed: must be an integer in [0, 2^63)"),
    ("draft_tokens", dict(draft_tokens=9), "draft_tokens: must be in [0, 8]"),
    ("stop", dict(stop=["x"] * 17), "stop: at most 16 stop strings"),
    ("stop_token_ids", dict(stop_token_ids=[-1]), "stop_token_ids: must be non-negative"),
]


@pytest.mark.parametrize("field,values,message", BAD_SAMPLING, ids=[f"{f}={v}" for f, v, _ in BAD_SAMPLING])
def test_out_of_range_sampling_is_invalid_argument(client, stack, field, values, message):
    e = failure(lambda: client.generate("hello", sampling=SamplingParams(**values)))
    assert e.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert e.details().startswith(message), e.details()
    assert_still_serving(client, stack)


BAD_PROMPTS = [
    ("empty prompt", dict(prompt=""), "prompt: must not be empty"),
    ("no prompt at all", dict(), "prompt: must not be empty"),
    ("empty token ids", dict(prompt_token_ids=[]), "prompt_token_ids: must not be empty"),
    ("token id outside the vocabulary", dict(prompt_token_ids=[1, 384]),
     "prompt_token_ids: token id 384 is outside the vocabulary [0, 384)"),
    ("chat message without a role", dict(messages=[("", "hi")]), "messages[0].role: must be one of system, user, assistant, tool"),
    ("prompt longer than the context", dict(prompt="x" * 4096), "prompt: 4096 prompt tokens leave no room "
                                                                "under the context limit of 4096 tokens"),
    ("prompt + max_tokens beyond the context", dict(prompt="x" * 100, sampling=SamplingParams(max_tokens=4000)),
     "max_tokens: prompt (100 tokens) + max_tokens (4000) = 4100 exceeds the context limit of 4096 tokens"),
    ("prompt + max_tokens beyond the KV capacity", dict(prompt="x" * 100, sampling=SamplingParams(max_tokens=1990)),
     f"max_tokens: prompt (100 tokens) + max_tokens (1990) + draft slots (0) exceeds the KV capacity of {KV} tokens"),
    ("unknown model", dict(prompt="hi", model="gpt-9"), "model: unknown model 'gpt-9'; this gateway serves"),
]


@pytest.mark.parametrize("kwargs,message", [c[1:] for c in BAD_PROMPTS], ids=[c[0] for c in BAD_PROMPTS])
def test_bad_prompts_are_invalid_argument(client, stack, kwargs, message):
    e = failure(lambda: client.generate(**kwargs))
    assert e.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert e.details().startswith(message), e.details()
    assert_still_serving(client, stack)


def test_an_oversized_message_is_resource_exhausted(client, stack):
    e = failure(lambda: client.generate("y" * (MAX_MESSAGE_BYTES + 1)))
    assert e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"exceeds the limit of {MAX_MESSAGE_BYTES} bytes (--max-message-bytes)" in e.details()
    assert (RETRY_PUSHBACK_KEY, str(PUSHBACK_MS)) in [(m.key, m.value) for m in e.trailing_metadata()]
    assert_still_serving(client, stack)


@pytest.mark.parametrize("payload", [b"\xff\xff\xff", b"\x0a\x05ab", b"\x12\x80\x80\x80\x80\x10"])
def test_malformed_bytes_are_invalid_argument_not_internal(stack, payload):
    with grpc.insecure_channel(stack.address) as channel:
        call = channel.unary_stream("/ninfer.v1.Gateway/Generate", request_serializer=None,
                                    response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            list(call(payload, timeout=10))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert "malformed request message" in e.value.details()


def test_bad_inputs_are_counted_by_status(stack):
    value = stack.registry.get_sample_value("ninfer_gateway_requests_total", {"status": "INVALID_ARGUMENT"})
    assert value >= len(BAD_SAMPLING) + len(BAD_PROMPTS)


def test_a_bearer_token_is_required_when_configured_and_reflection_is_behind_a_flag(stack):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    with grpc.insecure_channel(stack.address) as channel:       # the module's stack: reflection off
        with pytest.raises(grpc.RpcError) as e:
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert e.value.code() is grpc.StatusCode.UNIMPLEMENTED
    stack = ServeStack(EngineConfig(kv_capacity=KV),
                       ServerOptions(listen="127.0.0.1:0", api_key="s3cret", enable_reflection=True)).start()
    try:
        with grpc.insecure_channel(stack.address) as channel:   # reflection, like health, needs no token
            services = ProtoReflectionDescriptorDatabase(channel).get_services()
            assert {"ninfer.v1.Gateway", "grpc.health.v1.Health"} <= set(services)
        for key in (None, "wrong"):
            with GatewayClient(stack.address, api_key=key) as c:
                c.wait_until_serving(timeout_s=60)            # health needs no token
                e = failure(lambda: c.generate("hi"))
                assert e.code() is grpc.StatusCode.UNAUTHENTICATED
        with EngineClient(stack.engine.address) as engine:    # the serve stack's engine has its own token
            e = failure(lambda: [engine.metrics()])
            assert e.code() is grpc.StatusCode.UNAUTHENTICATED
        with GatewayClient(stack.address, api_key="s3cret") as c:
            *_, last = c.generate("hi", sampling=SamplingParams(max_tokens=2))
            assert last.result.stats.usage.completion_tokens >= 1
    finally:
        stack.stop()
