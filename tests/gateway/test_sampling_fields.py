"""The sampling fields of ninfer.v1 end to end through a real gateway and engine on 127.0.0.1 (the
prefill/decode split): logprobs streamed with their deltas and prompt logprobs in the first message,
n sequences each under its index with its own result, penalties and bias, include_stop_str_in_output
and min_tokens on the gateway's text, all equal to LLM.generate; bad values refused naming the field."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from engine import SamplingParams as EngineSampling
from engine.config import EngineConfig
from gateway.client import GatewayClient, SamplingParams
from gateway.serve import ServeStack
from services.convert import logprobs_from_proto, sampling_from_proto
from services.engine_client import EngineClient
from services.server.grpc_server import ServerOptions
from ninfer.v1 import common_pb2
from tests.conftest import make_llm
from tests.engine.structured.helpers import SCHEMA

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
SCHEMA_PROMPT = 'Return the record as JSON: {"name": "Omar Sato", "age": 67'


@pytest.fixture(scope="module")
def stack(shared_model):
    s = ServeStack(EngineConfig(model=shared_model, kv_capacity=4096, dtype="float32", draft_tokens=2),
                   ServerOptions(listen="127.0.0.1:0")).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm(shared_model):
    return make_llm(shared_model, draft_tokens=2, kv_capacity=4096)


def by_index(messages) -> dict[int, dict]:
    seqs: dict[int, dict] = {}
    for m in messages:
        s = seqs.setdefault(m.index, {"text": "", "ids": [], "logprobs": [], "result": None, "prompt": []})
        s["text"] += m.text
        s["ids"] += list(m.token_ids)
        s["logprobs"] += logprobs_from_proto(m.logprobs)
        s["prompt"] += logprobs_from_proto(m.prompt_logprobs)
        if m.HasField("result"):
            assert s["result"] is None, "one result per sequence"
            s["result"] = m.result
    return seqs


def test_logprobs_stream_with_their_tokens_and_equal_llm_generate(client, llm):
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    msgs = list(client.generate(PROMPT, sampling=sampling, include_token_ids=True))
    assert all(len(m.logprobs) == len(m.token_ids) for m in msgs)
    assert msgs[0].prompt_logprobs and not any(m.prompt_logprobs for m in msgs[1:])
    (seq,) = by_index(msgs).values()
    (ref,) = llm.generate(PROMPT, sampling_from_proto(sampling))
    assert seq["ids"] == ref.token_ids and seq["text"] == ref.text
    for got, want in zip(seq["logprobs"], ref.outputs[0].logprobs):
        (tid, lp), *_ = want.items()
        assert got.token_id == tid and abs(got.logprob - lp.logprob) < 1e-4 and len(got.top) == 3
    assert len(seq["prompt"]) == len(ref.prompt_token_ids) - 1                      # every prompt token but the first
    for got, want in zip(seq["prompt"], ref.prompt_logprobs[1:]):
        (tid, lp), *_ = want.items()
        assert got.token_id == tid and abs(got.logprob - lp.logprob) < 1e-4


def test_n_sequences_stream_under_their_index_each_with_its_result(client, llm, stack):
    sampling = SamplingParams(max_tokens=10, temperature=1.0, seed=21, ignore_eos=True, n=3)
    seqs = by_index(client.generate(PROMPT, sampling=sampling, include_token_ids=True))
    assert sorted(seqs) == [0, 1, 2]
    ref = llm.generate(PROMPT, sampling_from_proto(sampling))[0]
    for i, out in enumerate(ref.outputs):
        assert seqs[i]["ids"] == out.token_ids and seqs[i]["text"] == out.text
        assert seqs[i]["result"].stats.usage.completion_tokens == 10
    assert len({tuple(s["ids"]) for s in seqs.values()}) == 3
    with EngineClient(stack.engine.address, api_key=stack.engine_api_key) as engine:
        m = engine.wait_idle()
    assert m.kv.free_blocks == m.kv.num_blocks and m.kv.refs_taken == m.kv.refs_dropped


def test_penalties_bias_and_stop_options_equal_llm_generate(client, llm):
    for sampling in (
            SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.4, presence_penalty=0.5,
                           frequency_penalty=0.3, logit_bias={321: -100.0}, bad_words=["fib"], min_p=0.1),
            SamplingParams(max_tokens=30, temperature=0.0, stop=["\n"], include_stop_str_in_output=True),
            SamplingParams(max_tokens=30, temperature=0.0, stop=["\n"], min_tokens=8)):
        text = "".join(m.text for m in client.generate(PROMPT, sampling=sampling))
        (ref,) = llm.generate(PROMPT, sampling_from_proto(sampling))
        assert text == ref.text, sampling
    with_stop = llm.generate(PROMPT, EngineSampling(max_tokens=30, temperature=0.0, stop="\n",
                                                    include_stop_str_in_output=True))[0].text
    assert with_stop.endswith("\n")


def test_structured_output_with_logprobs_penalties_and_n(client, llm):
    """A JSON schema with the sampling fields through the gateway (prefill/decode split, k = 2): greedy
    with logprobs and a penalty, and n = 2 seeded sequences with a penalty, equal LLM.generate and
    validate (or are cut by max_tokens), each under its index with a logprob per token."""
    so = {"json_schema": json.dumps(SCHEMA)}
    greedy = SamplingParams(max_tokens=120, temperature=0.0, logprobs=2, repetition_penalty=1.2, structured_output=so)
    (seq,) = by_index(client.generate(SCHEMA_PROMPT, sampling=greedy, include_token_ids=True)).values()
    (ref,) = llm.generate(SCHEMA_PROMPT, sampling_from_proto(greedy))
    assert seq["ids"] == ref.token_ids and seq["text"] == ref.text
    assert seq["result"].stats.finish_reason == common_pb2.FINISH_REASON_STOP, seq["text"]
    jsonschema.validate(json.loads(seq["text"]), SCHEMA)
    assert [lp.token_id for lp in seq["logprobs"]] == seq["ids"]
    for got, want in zip(seq["logprobs"], ref.outputs[0].logprobs):
        assert abs(got.logprob - want[got.token_id].logprob) < 1e-4
    sampled = SamplingParams(max_tokens=120, temperature=1.0, seed=4, n=2, logprobs=1, presence_penalty=0.5,
                             structured_output=so)
    seqs = by_index(client.generate(SCHEMA_PROMPT, sampling=sampled, include_token_ids=True))
    (ref,) = llm.generate(SCHEMA_PROMPT, sampling_from_proto(sampled))
    assert sorted(seqs) == [0, 1] and seqs[0]["ids"] != seqs[1]["ids"]
    for i, s in seqs.items():
        assert s["ids"] == ref.outputs[i].token_ids and len(s["logprobs"]) == len(s["ids"])
        if s["result"].stats.finish_reason == common_pb2.FINISH_REASON_STOP:
            jsonschema.validate(json.loads(s["text"]), SCHEMA)
        else:
            assert len(s["ids"]) == 120 and s["text"].lstrip().startswith("{")


@pytest.mark.parametrize("sampling, field", [
    (SamplingParams(logprobs=21), "logprobs"),
    (SamplingParams(n=1000), "n"),
    (SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    (SamplingParams(structured_output={"regex": "([a-z"}), "structured_output.regex"),
    (SamplingParams(structured_output={"json_schema": '{"type": "objekt"}'}), "structured_output.json_schema"),
])
def test_bad_fields_are_invalid_argument_naming_the_field(client, sampling, field):
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate(PROMPT, sampling=sampling))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(f"{field}: "), \
        e.value.details()
