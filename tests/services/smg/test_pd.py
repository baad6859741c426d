"""Prefill/decode on different engines (`--kv-role producer|consumer`, services/smg/pd.py) with a real NIXL
agent moving the KV between two engine hosts on 127.0.0.1, driven by hand over smg's engine protocol and by
the real smg router (`smg launch --pd-disaggregation`): greedy output equals a single engine's (the PD pair
runs MTP k = 3, the single engine k = 0), the consumer takes the pulled blocks as cached tokens, the
producer frees its blocks on the consumer's notification or when the lease ends, and a pull that fails
answers UNAVAILABLE with nothing held on either side. Faults on real processes (a stale lease, a timeout,
no room, a producer or consumer killed): test_pd_faults.py."""

from __future__ import annotations

import base64
import json
import time

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb, vllm_engine_pb2_grpc

from engine.config import EngineConfig
from services.engine_client import EngineClient
from services.engine_host import EngineHost
from services.server.grpc_server import ServerOptions
from tests.support.hybrid import require_shared_hybrid
from tools.serving.smg_stack import SmgRouter, smg_command

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (the `test` extra installs nixl-cu12)")

MODEL = "tiny-qwen3-mtp"
LEASE_S = 3.0
PROMPT = list(range(300, 370))                   # 70 tokens: 4 full blocks of 16 lendable
REMOTE_DECODE = json.dumps({"do_remote_decode": True, "do_remote_prefill": False})
PREFIX = "The Python standard library is very extensive, offering a wide range of facilities. " * 3


def start_host(model: str, role: str, k: int) -> EngineHost:
    config = EngineConfig(model=model, dtype="float32", kv_capacity=2048, draft_tokens=k, kv_role=role,
                          lease_seconds=LEASE_S)
    return EngineHost(config, ServerOptions(listen="127.0.0.1:0")).start().load()


@pytest.fixture(scope="module")
def hosts(shared_model):
    started = []
    try:
        for role, k in (("producer", 3), ("consumer", 3), ("both", 0)):
            started.append(start_host(shared_model, role, k))
        yield dict(zip(("producer", "consumer", "single"), started))
    finally:
        for h in started:
            h.stop()


@pytest.fixture(scope="module")
def stubs(hosts):
    channels = {name: grpc.insecure_channel(h.address) for name, h in hosts.items()}
    yield {name: vllm_engine_pb2_grpc.VllmEngineStub(c) for name, c in channels.items()}
    for c in channels.values():
        c.close()


@pytest.fixture(scope="module")
def clients(hosts):
    made = {name: EngineClient(h.address) for name, h in hosts.items()}
    yield made
    for c in made.values():
        c.close()


def generate(stub, prompt=PROMPT, kv: str | None = None, max_tokens: int = 16, request_id: str = "pd-1",
             stream: bool = False) -> pb.GenerateComplete:
    request = pb.GenerateRequest(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=prompt),
                                 sampling_params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                 stream=stream)
    if kv is not None:
        request.kv_transfer_params_json = kv
    responses = list(stub.Generate(request, timeout=60))
    output = [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids]
    done = responses[-1].complete
    if stream:
        done.output_ids.extend(output)
    return done


def assert_nothing_held(client: EngineClient) -> None:
    m = client.wait_idle(timeout_s=10)
    assert m.queue.parked == 0 and m.queue.running == 0, m.queue
    assert m.kv.free_blocks == m.kv.num_blocks, f"{m.kv.num_blocks - m.kv.free_blocks} blocks held"
    assert m.kv.refs_taken == m.kv.refs_dropped


def cache_hits(client: EngineClient) -> int:
    """Prompt tokens the engine took from its prefix cache, over the metrics' history."""
    return sum(client.metrics().history.cache_hit_tokens)


def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_server_info_names_the_connector_role_and_engine(stubs):
    info = {name: s.GetServerInfo(pb.GetServerInfoRequest(), timeout=10) for name, s in stubs.items()}
    assert info["producer"].kv_connector == info["consumer"].kv_connector == "NixlConnector"
    assert (info["producer"].kv_role, info["consumer"].kv_role) == ("kv_producer", "kv_consumer")
    assert info["producer"].kv_engine_id != info["consumer"].kv_engine_id
    assert info["producer"].kv_engine_id.startswith("ninfer-")
    assert (info["single"].kv_connector, info["single"].kv_role) == ("", "")      # today's behaviour


def test_the_two_legs_by_hand_decode_what_one_engine_decodes_from_pulled_blocks(stubs, clients):
    single = generate(stubs["single"])
    for stream in (False, True):
        stubs["consumer"].FlushCache(common_pb2.FlushCacheRequest(), timeout=10)     # no cached copy: a real pull
        prefill = generate(stubs["producer"], kv=REMOTE_DECODE, max_tokens=1, request_id=f"pd-{stream}")
        assert prefill.finish_reason == "length" and list(prefill.output_ids) == list(single.output_ids[:1])
        handoff = json.loads(prefill.kv_transfer_params_json)
        assert handoff["do_remote_prefill"] is True and len(handoff["remote_block_ids"]) == 4
        assert clients["producer"].metrics().queue.parked == 1            # the KV waits for its consumer
        decode = generate(stubs["consumer"], kv=prefill.kv_transfer_params_json, stream=stream,
                          request_id=f"pd-{stream}")
        assert list(decode.output_ids) == list(single.output_ids)      # k = 3 over pulled KV == k = 0 alone
        assert decode.cached_tokens == 64                              # the 4 pulled blocks, not recomputed
        assert decode.spec_draft_tokens > 0
        assert wait_for(lambda: clients["producer"].metrics().queue.parked == 0), "notified: the lease ends"
        for name in ("producer", "consumer"):
            assert_nothing_held(clients[name])


def test_a_prompt_under_two_blocks_lends_nothing_and_the_consumer_recomputes_it(stubs, clients):
    short = list(range(500, 510))
    prefill = generate(stubs["producer"], prompt=short, kv=REMOTE_DECODE, max_tokens=1, request_id="pd-short")
    assert json.loads(prefill.kv_transfer_params_json)["do_remote_prefill"] is False
    decode = generate(stubs["consumer"], prompt=short, kv=prefill.kv_transfer_params_json, request_id="pd-short")
    assert list(decode.output_ids) == list(generate(stubs["single"], prompt=short).output_ids)
    for name in ("producer", "consumer"):
        assert_nothing_held(clients[name])


def test_a_lease_no_consumer_claims_ends_and_frees_the_producer_s_blocks(stubs, clients):
    prefill = generate(stubs["producer"], kv=REMOTE_DECODE, max_tokens=1, request_id="pd-orphan")
    assert json.loads(prefill.kv_transfer_params_json)["remote_block_ids"]
    m = clients["producer"].metrics()
    assert m.queue.parked == 1 and m.kv.free_blocks < m.kv.num_blocks
    assert wait_for(lambda: clients["producer"].metrics().queue.parked == 0, timeout_s=LEASE_S + 5)
    assert_nothing_held(clients["producer"])


def test_a_pull_that_fails_is_unavailable_and_holds_nothing(stubs, clients):
    prefill = generate(stubs["producer"], kv=REMOTE_DECODE, max_tokens=1, request_id="pd-fail")
    handoff = json.loads(prefill.kv_transfer_params_json)
    outside = dict(handoff, remote_spans=[[base + (1 << 40), stride, size] for base, stride, size in handoff["remote_spans"]])
    unknown = dict(handoff, remote_agent_metadata=base64.b64encode(b"not an agent").decode())
    for bad in (outside, unknown):
        with pytest.raises(grpc.RpcError) as e:
            generate(stubs["consumer"], kv=json.dumps(bad), request_id="pd-fail")
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE, e.value.details()
        assert "pulling the prompt's KV from producer" in e.value.details()
        assert_nothing_held(clients["consumer"])
    stubs["producer"].Abort(pb.AbortRequest(request_ids=["pd-fail"]), timeout=10)
    assert_nothing_held(clients["producer"])


@pytest.mark.parametrize("mutate, field", [
    (lambda h: "{not json", "kv_transfer_params_json"),
    (lambda h: json.dumps(dict(h, remote_spans=h["remote_spans"][:-1])), "kv_transfer_params_json.spans"),
    (lambda h: json.dumps(dict(h, num_prompt_tokens=3)), "kv_transfer_params_json.num_prompt_tokens"),
    (lambda h: json.dumps(dict(h, remote_block_ids=list(range(9)))), "kv_transfer_params_json.remote_block_ids"),
    (lambda h: json.dumps(dict(h, remote_agent_metadata="!!")), "kv_transfer_params_json.remote_agent_metadata"),
    (lambda h: json.dumps(dict(h, remote_lease=[4096, 0])), "kv_transfer_params_json.remote_lease"),
])
def test_a_bad_hand_off_is_invalid_argument_naming_the_field(stubs, clients, mutate, field):
    handoff = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "ninfer-x",
               "remote_agent_metadata": base64.b64encode(b"x").decode(), "remote_request_id": "r",
               "num_prompt_tokens": len(PROMPT), "remote_block_ids": [0],
               "remote_spans": [[4096, 4096, 2048]] * 2, "remote_lease": [4096, 1]}
    info = stubs["consumer"].GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert info.kv_role == "kv_consumer"
    # the consumer's own layout, so that only the mutated field is wrong
    own = json.loads(generate(stubs["producer"], kv=REMOTE_DECODE, max_tokens=1,
                              request_id=f"pd-bad-{field}").kv_transfer_params_json)
    handoff["remote_spans"] = own["remote_spans"]
    with pytest.raises(grpc.RpcError) as e:
        generate(stubs["consumer"], kv=mutate(handoff), request_id="pd-bad")
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), e.value.details()
    assert_nothing_held(clients["consumer"])
    stubs["producer"].Abort(pb.AbortRequest(request_ids=[f"pd-bad-{field}"]), timeout=10)


@pytest.mark.skipif(smg_command() is None, reason="smg is not installed (the `test` extra installs it)")
def test_through_smg_pd_greedy_text_equals_a_single_engine_k3_against_k0(hosts, clients, shared_model,
                                                                         tmp_path):
    pd = SmgRouter.start_pd([hosts["producer"].address], [hosts["consumer"].address], shared_model,
                            tmp_path / "smg-pd.log")
    single = SmgRouter.start([hosts["single"].address], shared_model, tmp_path / "smg.log")
    try:
        pd.wait_until_ready(workers=2, model=MODEL, timeout_s=60)
        single.wait_until_ready(workers=1, model=MODEL, timeout_s=60)
        hits = cache_hits(clients["consumer"])
        for prompt in (PREFIX + "alpha", "def fibonacci(n):"):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            via_pd, alone = pd.completion(body), single.completion(body)
            assert via_pd["choices"][0]["text"] == alone["choices"][0]["text"] and alone["choices"][0]["text"]
            assert via_pd["usage"]["completion_tokens"] == 24
            # smg 1.13's PD usage leaves out the decode leg's cached tokens: the consumer's own count says
            # the lendable blocks were pulled and taken as a prefix hit, not recomputed
            lent = (via_pd["usage"]["prompt_tokens"] - 1) // 16 * 16
            assert cache_hits(clients["consumer"]) - hits == lent
            events = list(pd.stream_completion(body))
            assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == alone["choices"][0]["text"]
            hits = cache_hits(clients["consumer"])
        for name in ("producer", "consumer"):
            assert wait_for(lambda: clients[name].metrics().queue.parked == 0), f"{name}: a lease still held"
            assert_nothing_held(clients[name])
    finally:
        pd.stop()
        single.stop()


def test_a_hybrid_pair_recomputes_the_prompt_exactly_its_state_is_not_moved():
    """Qwen3.5 hybrids: the linear-attention state does not move yet, so the consumer's prefix hit stops
    at a state snapshot (none for pulled blocks) and it recomputes the prompt: the same tokens, no saving."""
    model = require_shared_hybrid()
    producer, consumer = start_host(model, "producer", 0), start_host(model, "consumer", 0)
    try:
        with grpc.insecure_channel(producer.address) as p, grpc.insecure_channel(consumer.address) as c, \
                EngineClient(producer.address) as pc, EngineClient(consumer.address) as cc:
            p_stub, c_stub = vllm_engine_pb2_grpc.VllmEngineStub(p), vllm_engine_pb2_grpc.VllmEngineStub(c)
            alone = generate(p_stub, request_id="hy-alone")     # untagged: the producer serves it whole
            prefill = generate(p_stub, kv=REMOTE_DECODE, max_tokens=1, request_id="hy")
            decode = generate(c_stub, kv=prefill.kv_transfer_params_json, request_id="hy")
            assert list(decode.output_ids) == list(alone.output_ids)
            assert decode.cached_tokens == 0
            assert wait_for(lambda: pc.metrics().queue.parked == 0)
            for client in (pc, cc):
                assert_nothing_held(client)
    finally:
        producer.stop()
        consumer.stop()
