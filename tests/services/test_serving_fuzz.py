"""Property-based fuzz of live servers (hypothesis, derandomized so CI is repeatable): every field of
GenerateRequest, PrefillRequest and DecodeRequest, and raw bytes sent to every method. Every answer
is OK or a documented status (docs/architecture.md, "Error model"), never INTERNAL or UNKNOWN; afterwards the
servers are healthy, the engine is idle with every KV block free and every reference dropped, and
the gateway has nothing in flight.

The context is small (max_model_len 64), so that any request that is accepted finishes in well
under a second on the CPU.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from gateway.client import GatewayClient
from gateway.serve import ServeStack
from ninfer.v1 import common_pb2, decode_pb2, gateway_pb2, prefill_pb2
from services.engine_client import EngineClient
from services.server.grpc_server import ServerOptions

MAX_MODEL_LEN = 64
EXAMPLES = 200
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])
DOCUMENTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
COUNTS: dict[str, int] = {}

int32 = st.integers(-(2**31), 2**31 - 1)
small_or_any_int = st.one_of(st.integers(-3, 80), int32)
any_float = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1e-40, -0.0, 1e-5, 2.0]))
token_ids = st.lists(st.one_of(st.integers(-5, 400), int32), max_size=80)
text = st.text(max_size=120)


@st.composite
def sampling_params(draw) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams()
    if draw(st.booleans()):
        p.max_tokens = draw(small_or_any_int)
    if draw(st.booleans()):
        p.temperature = draw(any_float)
    if draw(st.booleans()):
        p.top_p = draw(any_float)
    p.top_k = draw(small_or_any_int)
    if draw(st.booleans()):
        p.seed = draw(st.integers(0, 2**64 - 1))
    p.stop.extend(draw(st.lists(text, max_size=20)))
    p.stop_token_ids.extend(draw(st.lists(st.one_of(st.integers(-3, 400), int32), max_size=8)))
    p.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        p.draft_tokens = draw(small_or_any_int)
    return p


@st.composite
def generate_requests(draw) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(sampling=draw(sampling_params()), model=draw(st.sampled_from(["", "x"])))
    kind = draw(st.sampled_from(["prompt", "messages", "ids", "none"]))
    if kind == "prompt":
        req.prompt = draw(st.text(max_size=300))
    elif kind == "messages":
        for role, content in draw(st.lists(st.tuples(st.sampled_from(["", "user", "system", "x"]), text), max_size=6)):
            req.messages.messages.add(role=role, content=content)
    elif kind == "ids":
        req.prompt_token_ids.ids.extend(draw(token_ids))
    req.stream_options.include_token_ids = draw(st.booleans())
    req.stream_options.continuous_usage_stats = draw(st.booleans())
    return req


@pytest.fixture(scope="module")
def stack():
    s = ServeStack(EngineConfig(kv_capacity=2048, max_model_len=MAX_MODEL_LEN, max_pending=64),
                   ServerOptions(listen="127.0.0.1:0")).start()
    with GatewayClient(s.address) as client:
        client.wait_until_serving(timeout_s=60)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gateway(stack):
    with GatewayClient(stack.address) as c:
        yield c


@pytest.fixture(scope="module")
def engine(stack):
    with EngineClient(stack.engine.address, stack.engine_api_key) as e:
        yield e


def status_of(consume) -> grpc.StatusCode:
    try:
        consume()
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        assert e.code() in DOCUMENTED, (e.code(), e.details())
        return e.code()


def count(target: str) -> None:
    COUNTS[target] = COUNTS.get(target, 0) + 1


@FUZZ
@given(req=generate_requests())
def test_generate_fuzz(gateway, req):
    count("generate")
    status_of(lambda: list(gateway.stub.Generate(req, timeout=30, metadata=gateway.metadata)))


@FUZZ
@given(request_id=st.one_of(st.just(""), text), ids=token_ids, sampling=sampling_params(), release=st.booleans())
def test_prefill_fuzz(engine, request_id, ids, sampling, release):
    count("prefill")
    responses = []

    def prefill():
        responses.append(engine.prefill_stub.Prefill(
            prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=ids, sampling=sampling),
            timeout=30, metadata=engine.metadata))
    if status_of(prefill) is grpc.StatusCode.OK and not responses[0].finished:
        handle = responses[0].handle
        if release:
            status_of(lambda: engine.release(handle))
        else:
            status_of(lambda: list(engine.decode(handle, timeout=30)))


@FUZZ
@given(handle=st.one_of(text, st.binary(max_size=40).map(lambda b: b.decode("latin-1"))))
def test_decode_and_release_fuzz(engine, handle):
    count("decode")
    status_of(lambda: list(engine.decode_stub.Decode(decode_pb2.DecodeRequest(handle=handle), timeout=10,
                                                     metadata=engine.metadata)))
    status_of(lambda: engine.release(handle))


METHODS = [("gateway", "/ninfer.v1.Gateway/Generate", True), ("engine", "/ninfer.v1.PrefillService/Prefill", False),
           ("engine", "/ninfer.v1.DecodeService/Decode", True), ("engine", "/ninfer.v1.PrefillService/Release", False)]


@FUZZ
@given(payload=st.binary(max_size=400), method=st.sampled_from(METHODS))
def test_raw_bytes_fuzz(gateway, engine, payload, method):
    count("raw_bytes")
    server, path, streaming = method
    client = gateway if server == "gateway" else engine
    if streaming:
        call = client.channel.unary_stream(path)
        status_of(lambda: list(call(payload, timeout=30, metadata=client.metadata)))
    else:
        call = client.channel.unary_unary(path)
        status_of(lambda: call(payload, timeout=30, metadata=client.metadata))


def test_after_the_fuzz_the_servers_are_healthy_and_idle(stack, gateway, engine):
    """Runs last in this module (pytest keeps file order)."""
    assert gateway.serving_status() == health_pb2.HealthCheckResponse.SERVING
    assert engine.serving_status() == health_pb2.HealthCheckResponse.SERVING
    m = engine.wait_idle(timeout_s=10)
    q = m.queue
    assert (q.waiting, q.prefilling, q.running) == (0, 0, 0)
    # a handle fuzzed by raw bytes may be parked still (a Prefill whose handle nobody knows): release it
    for handle in stack.engine.loop.call(lambda core: list(core.scheduler.parked)):
        engine.release(handle)
    m = engine.wait_idle(timeout_s=10)
    assert m.kv.free_blocks == m.kv.num_blocks and m.kv.refs_taken == m.kv.refs_dropped
    assert [n for _, _, n in stack.gateway.router.loads()] == [0] and stack.gateway.state.in_flight == 0
    print(f"fuzz examples run: {COUNTS}")
