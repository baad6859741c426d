"""smg's engine protocol (vLLM's `VllmEngine`, services/smg) on a real engine host over gRPC on
127.0.0.1: streamed and unary Generate agree with ninfer.v1 token for token, usage, cached tokens and
MTP acceptance in the final message, our exact stats in the trailer, validation with our status
codes, Abort and a dropped call free the KV, loads, model and server info, the tokenizer bundle,
KV events a router can index, and the bearer token."""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb, vllm_engine_pb2_grpc

from engine.config import EngineConfig
from ninfer.v1 import common_pb2 as ninfer_common
from services.engine_client import EngineClient
from services.engine_host import EngineHost
from services.server.grpc_server import ServerOptions
from services.smg.vllm_servicer import STATS_TRAILER

API_KEY = "smg-test-key"
AUTH = (("authorization", f"Bearer {API_KEY}"),)
PROMPT = list(range(300, 370))                   # 70 tokens: 4 full blocks of 16
K = 2


@pytest.fixture(scope="module")
def host(shared_model):
    h = EngineHost(EngineConfig(model=shared_model, dtype="float32", kv_capacity=2048, draft_tokens=K),
                   ServerOptions(listen="127.0.0.1:0", api_key=API_KEY)).start().load()
    yield h
    h.stop()


@pytest.fixture(scope="module")
def stub(host):
    channel = grpc.insecure_channel(host.address)
    yield vllm_engine_pb2_grpc.VllmEngineStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def engine(host):
    with EngineClient(host.address, api_key=API_KEY) as client:
        yield client


def generate(stub, prompt, stream=False, request_id="", **sampling):
    request = pb.GenerateRequest(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=prompt),
                                 sampling_params=pb.SamplingParams(**sampling), stream=stream)
    return stub.Generate(request, metadata=AUTH, timeout=60)


def assert_kv_idle(engine: EngineClient) -> None:
    m = engine.wait_idle()
    assert m.kv.free_blocks == m.kv.num_blocks and m.kv.refs_taken == m.kv.refs_dropped


def test_streamed_and_unary_generate_match_ninfer_v1_and_report_usage(stub, engine):
    sampling = ninfer_common.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = engine.prefill(PROMPT, sampling)
    reference = list(first.token_ids) + [t for m in engine.decode(first.handle) for t in m.token_ids]

    call = generate(stub, PROMPT, stream=True, temperature=0.0, max_tokens=12, ignore_eos=True)
    msgs = list(call)
    chunks, final = [m.chunk for m in msgs[:-1]], msgs[-1].complete
    assert all(m.WhichOneof("response") == "chunk" for m in msgs[:-1]) and msgs[-1].WhichOneof("response") == "complete"
    assert [t for c in chunks for t in c.token_ids] == reference
    assert [c.completion_tokens for c in chunks] == sorted(c.completion_tokens for c in chunks)
    assert chunks[-1].completion_tokens == 12 and chunks[0].prompt_tokens == len(PROMPT)
    assert final.finish_reason == "length" and final.completion_tokens == 12 and not final.output_ids
    assert final.cached_tokens == 64                 # the ninfer.v1 request left 4 blocks cached
    assert final.spec_draft_tokens > 0 and 0 <= final.spec_accepted_tokens <= final.spec_draft_tokens
    stats = ninfer_common.RequestStats.FromString(dict(call.trailing_metadata())[STATS_TRAILER])
    assert stats.usage.cached_tokens == 64 and stats.speculative.draft_tokens == K
    assert stats.speculative.drafted == final.spec_draft_tokens and stats.speculative.accepted == final.spec_accepted_tokens
    assert stats.timings.ttft_seconds > 0 and stats.timings.decode_seconds > 0 and stats.rates.decode_tok_s > 0

    (only,) = list(generate(stub, PROMPT, temperature=0.0, max_tokens=12, ignore_eos=True))
    assert list(only.complete.output_ids) == reference and only.complete.prompt_tokens == len(PROMPT)
    assert_kv_idle(engine)


def test_a_stop_token_is_reported_as_matched(stub, engine):
    (free,) = list(generate(stub, PROMPT, temperature=0.0, max_tokens=6, ignore_eos=True))
    stop = free.complete.output_ids[2]
    (done,) = list(generate(stub, PROMPT, temperature=0.0, max_tokens=6, stop_token_ids=[stop]))
    assert done.complete.finish_reason == "stop" and done.complete.matched_token_id == stop
    assert list(done.complete.output_ids) == list(free.complete.output_ids[:list(free.complete.output_ids).index(stop) + 1])


@pytest.mark.parametrize("sampling,field", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"min_p": 1.5}, "sampling_params.min_p: must be in [0, 1]"),
    ({"presence_penalty": 2.5}, "sampling_params.presence_penalty: must be in [-2, 2]"),
    ({"n": 200}, "sampling_params.n: must be an integer in [1, 128]"),
    ({"n": 100}, "sampling_params.n: 100 sequences exceed the decode batch of 64"),
    ({"logprobs": 21}, "sampling_params.logprobs: must be an integer in [0, 20]"),
    ({"logprobs": -1}, "sampling_params.logprobs: must be an integer in [0, 20]"),
    ({"logit_bias": {8192: 1.0}}, "sampling_params.logit_bias: token id 8192 is outside the vocabulary"),
    ({"logit_bias": {5: 101.0}}, "sampling_params.logit_bias: bias of token 5 must be in [-100, 100]"),
    ({"json_schema": "{not json"}, "sampling_params.structured_output.json_schema: not valid JSON"),
    ({"regex": "[a-z]{1,100000}"}, "sampling_params.structured_output.regex"),
    ({"choice": pb.ChoiceConstraint(choices=[])}, "sampling_params.structured_output.choice"),
])
def test_bad_or_unsupported_sampling_is_invalid_argument_naming_the_field(stub, sampling, field):
    with pytest.raises(grpc.RpcError) as e:
        list(generate(stub, PROMPT, **sampling))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()


def test_bad_inputs_are_invalid_argument(stub):
    with pytest.raises(grpc.RpcError) as e:
        list(generate(stub, [1, 2, 99999], max_tokens=2))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "tokenized.input_ids" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(text="hello"), metadata=AUTH))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "text" in e.value.details()


def test_abort_rpc_and_a_dropped_call_free_the_kv(stub, engine):
    call = generate(stub, PROMPT, stream=True, request_id="to-abort", max_tokens=1500, ignore_eos=True)
    next(call)
    stub.Abort(pb.AbortRequest(request_ids=["to-abort", "unknown-id"]), metadata=AUTH)
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() is grpc.StatusCode.CANCELLED
    assert_kv_idle(engine)

    call = generate(stub, PROMPT, stream=True, max_tokens=1500, ignore_eos=True)
    next(call)
    call.cancel()
    assert_kv_idle(engine)
    assert engine.metrics().performance.requests["abort"] == 2


def test_loads_reflect_a_running_request(stub, engine, host):
    idle = stub.GetLoads(pb.GetLoadsRequest(), metadata=AUTH)
    assert idle.dp_rank_count == 1 and idle.loads[0].num_running_reqs == 0
    assert idle.loads[0].max_total_num_tokens == 2048 and idle.loads[0].max_running_requests == host.config.max_batch
    call = generate(stub, PROMPT, stream=True, max_tokens=1500, ignore_eos=True)
    next(call)
    busy = stub.GetLoads(pb.GetLoadsRequest(), metadata=AUTH).loads[0]
    assert busy.num_running_reqs == 1 and busy.num_used_tokens >= len(PROMPT) and busy.token_usage > 0
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=AUTH)
    assert info.active_requests == 1 and info.block_size == 16 and not info.is_paused
    call.cancel()
    assert_kv_idle(engine)


def test_model_info_and_tokenizer_bundle(stub, shared_model):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH)
    assert info.served_model_name == "tiny-qwen3-mtp" and info.model_path == shared_model
    assert info.max_context_length > 0 and info.vocab_size == 8192 and list(info.eos_token_ids) == [0]
    assert info.model_type == "qwen3" and list(info.architectures) == ["Qwen3ForCausalLM"] and info.is_generation
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), metadata=AUTH))
    data = b"".join(c.data for c in chunks)
    assert [c.sha256 for c in chunks[:-1]] == [""] * (len(chunks) - 1)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert archive.read("tokenizer.json") == (Path(shared_model) / "tokenizer.json").read_bytes()
        assert "tokenizer_config.json" in archive.namelist()


def test_kv_events_announce_the_prompt_blocks_a_router_would_hash(stub, engine, host):
    start = host.smg.kv_events.sequence_number if host.smg.kv_events else 0
    events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=start),
                                    metadata=AUTH, timeout=60)
    prompt = list(range(1000, 1050))             # 3 full blocks, new to this engine
    list(generate(stub, prompt, max_tokens=2, ignore_eos=True))
    batch = next(events)
    stored = batch.events[0].stored
    assert batch.sequence_number == start + 1 and not stored.HasField("parent_block_hash")
    assert [list(b.token_ids) for b in stored.blocks] == [prompt[0:16], prompt[16:32], prompt[32:48]]
    assert all(b.block_size == 16 for b in stored.blocks)
    assert len({b.block_hash for b in stored.blocks}) == 3
    events.cancel()


def test_every_call_needs_the_bearer_token(stub):
    for call in (lambda: stub.GetLoads(pb.GetLoadsRequest()),
                 lambda: list(stub.Generate(pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=PROMPT))))):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert stub.HealthCheck(pb.HealthCheckRequest(), metadata=AUTH).healthy


def test_flush_cache_forgets_cached_blocks_and_announces_it(stub, engine, host):
    list(generate(stub, PROMPT, max_tokens=2, ignore_eos=True))
    start = host.smg.kv_events.sequence_number
    events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=start),
                                    metadata=AUTH, timeout=60)
    assert stub.FlushCache(common_pb2.FlushCacheRequest(), metadata=AUTH).success
    removed = next(events).events[0].removed
    assert len(removed.block_hashes) >= 4
    events.cancel()
    (after,) = list(generate(stub, PROMPT, max_tokens=2, ignore_eos=True))
    assert after.complete.cached_tokens == 0


def test_logprobs_stream_with_the_tokens_and_match_the_unary_answer(stub, engine):
    sampling = dict(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    (unary,) = list(generate(stub, PROMPT, **sampling))
    done = unary.complete
    lp = done.output_logprobs
    assert list(lp.token_ids) == list(done.output_ids) and len(lp.token_logprobs) == 10
    for top, chosen, value in zip(lp.top_logprobs, lp.token_ids, lp.token_logprobs):
        assert len(top.values) == 3 and list(top.values) == sorted(top.values, reverse=True)
        assert top.token_ids[0] == chosen and abs(top.values[0] - value) < 1e-6       # greedy: the top one
    chunks = [m.chunk for m in generate(stub, PROMPT, stream=True, **sampling) if m.WhichOneof("response") == "chunk"]
    assert [t for c in chunks for t in c.output_logprobs.token_ids] == list(done.output_ids)
    assert all(len(c.output_logprobs.token_ids) == len(c.token_ids) for c in chunks)
    streamed = [v for c in chunks for v in c.output_logprobs.token_logprobs]
    assert max(abs(a - b) for a, b in zip(streamed, lp.token_logprobs)) < 1e-4
    # echo + max_tokens 0 (how lm-evaluation-harness scores): the prompt's logprobs, no token
    (scored,) = list(generate(stub, PROMPT, max_tokens=0, logprobs=2))
    inp = scored.complete.input_logprobs
    assert not scored.complete.output_ids and list(inp.token_ids) == PROMPT
    assert not inp.token_logprobs[0].HasField("value") and all(t.HasField("value") for t in inp.token_logprobs[1:])
    assert all(len(t.values) == 2 for t in inp.top_logprobs[1:])
    assert_kv_idle(engine)


def test_n_sequences_each_finish_under_their_index(stub, engine):
    sampling = dict(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, n=3)
    finals = [m.complete for m in generate(stub, PROMPT, **sampling)]
    assert sorted(f.index for f in finals) == [0, 1, 2] and len({tuple(f.output_ids) for f in finals}) == 3
    msgs = list(generate(stub, PROMPT, stream=True, **sampling))
    per_index = {}
    for m in msgs:
        if m.WhichOneof("response") == "chunk":
            per_index.setdefault(m.chunk.index, []).extend(m.chunk.token_ids)
    assert {i: per_index[i] for i in range(3)} == {f.index: list(f.output_ids) for f in finals}   # seeded: the same
    assert sorted(m.complete.index for m in msgs if m.WhichOneof("response") == "complete") == [0, 1, 2]
    assert_kv_idle(engine)


def test_penalties_and_bias_give_what_ninfer_v1_gives(stub, engine):
    options = dict(presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.3, min_tokens=4, min_p=0.05,
                   logit_bias={85: -100.0, 301: 5.0})       # the plain first token banned
    first = engine.prefill(PROMPT, ninfer_common.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                                **options))
    reference = list(first.token_ids) + [t for m in engine.decode(first.handle) for t in m.token_ids]
    (smg,) = list(generate(stub, PROMPT, temperature=0.0, max_tokens=12, ignore_eos=True, **options))
    assert list(smg.complete.output_ids) == reference
    (plain,) = list(generate(stub, PROMPT, temperature=0.0, max_tokens=12, ignore_eos=True))
    assert list(plain.complete.output_ids) != reference
    assert_kv_idle(engine)
