"""Prefill/decode on different engines (`--kv-role producer|consumer`, services/smg/pd.py) with a real NIXL
agent moving the KV between two engine hosts on 127.0.0.1, driven by hand over smg's engine protocol and by
the real smg router (`smg launch --pd-disaggregation`): greedy output equals a single engine's (the PD pair
runs MTP k = 3, the single engine k = 0), the consumer decodes from the pulled state (blocks; the
hybrid's linear-attention state slot; the MTP hidden row) recomputing no prompt token, the producer frees
what it lent on the consumer's notification or when the lease ends, and a pull that fails answers
UNAVAILABLE with nothing held on either side. Faults on real processes (a stale lease, a timeout, no room,
a producer or consumer killed): test_pd_faults.py."""

from __future__ import annotations

import base64
import json
import os
from types import SimpleNamespace

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb, vllm_engine_pb2_grpc

from engine.config import EngineConfig
from services.engine_client import EngineClient
from services.engine_host import EngineHost
from services.server.grpc_server import ServerOptions
from tests.support.hybrid import require_shared_hybrid
from tests.support.pd import PROMPT, REMOTE_DECODE, assert_nothing_held, generate, leases_expired
from tests.support.polling import wait_for
from tools.serving.smg_stack import SmgRouter, smg_command

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (the `test` extra installs nixl-cu12)")

MODEL = "tiny-qwen3-mtp"
LEASE_S = 3.0
HYBRID_TOKENS = 10                               # the hybrid decodes slower on CPU: fewer tokens
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


def cache_hits(client: EngineClient) -> int:
    """Prompt tokens the engine took from its prefix cache (or pulled), over the metrics' history."""
    return sum(client.metrics().history.cache_hit_tokens)


def prefill_computed(client: EngineClient) -> int:
    """Prompt tokens the engine's prefill computed, over the metrics' history."""
    return sum(client.metrics().history.prefill_tokens)


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
        assert handoff["do_remote_prefill"] is True and len(handoff["remote_block_ids"]) == 5
        assert handoff["first_token_id"] == single.output_ids[0] and handoff["remote_hidden_row"] >= 0
        assert handoff["remote_state_spans"] == []                      # a dense model: no state slot
        assert clients["producer"].metrics().queue.parked == 1            # the KV waits for its consumer
        computed = prefill_computed(clients["consumer"])
        decode = generate(stubs["consumer"], kv=prefill.kv_transfer_params_json, stream=stream,
                          request_id=f"pd-{stream}")
        assert list(decode.output_ids) == list(single.output_ids)      # k = 3 over pulled KV == k = 0 alone
        assert decode.cached_tokens == len(PROMPT)                     # every prompt token pulled, ...
        assert prefill_computed(clients["consumer"]) == computed       # ... none recomputed
        assert decode.spec_draft_tokens > 0
        assert wait_for(lambda: clients["producer"].metrics().queue.parked == 0), "notified: the lease ends"
        for name in ("producer", "consumer"):
            assert_nothing_held(clients[name])


def test_penalties_truncation_and_logprobs_through_the_two_legs(stubs, clients):
    """The consumer's logit options start from the prompt and the moved first token, as after a prefill; a
    truncated prompt is the kept tail on both legs; a request for logprobs computes its prompt."""
    penalties = dict(repetition_penalty=1.5, frequency_penalty=0.8, presence_penalty=0.4)
    single = generate(stubs["single"], request_id="pd-pen", **penalties)
    prefill = generate(stubs["producer"], kv=REMOTE_DECODE, max_tokens=1, request_id="pd-pen", **penalties)
    decode = generate(stubs["consumer"], kv=prefill.kv_transfer_params_json, request_id="pd-pen",
                      **penalties)
    assert list(decode.output_ids) == list(single.output_ids) != list(generate(stubs["single"]).output_ids)
    assert decode.cached_tokens == len(PROMPT)
    # a truncated prompt: both legs mean the kept tail (the hand-off's blocks and length are its)
    kept = dict(truncate_prompt_tokens=40)
    prefill = generate(stubs["producer"], kv=REMOTE_DECODE, max_tokens=1, request_id="pd-cut", **kept)
    assert json.loads(prefill.kv_transfer_params_json)["num_prompt_tokens"] == 40
    decode = generate(stubs["consumer"], kv=prefill.kv_transfer_params_json, max_tokens=4, request_id="pd-cut", **kept)
    assert list(decode.output_ids) == list(generate(stubs["single"], prompt=PROMPT[-40:], max_tokens=4).output_ids)
    assert decode.cached_tokens == 40
    # logprobs: the first token's are not moved, so the consumer computes the prompt; with no full block
    # below a short prompt's last token it pulls nothing and tells the producer to free at once
    short = list(range(500, 510))
    expired = leases_expired(clients["producer"])
    prefill = generate(stubs["producer"], prompt=short, kv=REMOTE_DECODE, max_tokens=1, request_id="pd-lp", logprobs=1)
    decode = generate(stubs["consumer"], prompt=short, kv=prefill.kv_transfer_params_json, max_tokens=4,
                      request_id="pd-lp", logprobs=1)
    assert list(decode.output_ids) == list(generate(stubs["single"], prompt=short, max_tokens=4).output_ids)
    assert decode.cached_tokens == 0
    assert wait_for(lambda: clients["producer"].metrics().queue.parked == 0)
    assert leases_expired(clients["producer"]) == expired, "released on the consumer's word, not by its lease"
    for name in ("producer", "consumer"):
        assert wait_for(lambda: clients[name].metrics().queue.parked == 0)
        assert_nothing_held(clients[name])


def test_a_prompt_under_one_block_moves_whole_too(stubs, clients):
    short = list(range(500, 510))
    prefill = generate(stubs["producer"], prompt=short, kv=REMOTE_DECODE, max_tokens=1, request_id="pd-short")
    assert len(json.loads(prefill.kv_transfer_params_json)["remote_block_ids"]) == 1
    decode = generate(stubs["consumer"], prompt=short, kv=prefill.kv_transfer_params_json, request_id="pd-short")
    assert list(decode.output_ids) == list(generate(stubs["single"], prompt=short).output_ids)
    assert decode.cached_tokens == len(short)
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
    (lambda h: json.dumps(dict(h, remote_block_ids=list(range(4)))), "kv_transfer_params_json.remote_block_ids"),
    (lambda h: json.dumps(dict(h, first_token_id=-1)), "kv_transfer_params_json.first_token_id"),
    (lambda h: json.dumps(dict(h, remote_hidden_spans=[])), "kv_transfer_params_json.remote_hidden_spans"),
    (lambda h: json.dumps(dict(h, remote_state_spans=[[4096, 4096, 64]])), "kv_transfer_params_json.remote_state_spans"),
    (lambda h: json.dumps(dict(h, remote_agent_metadata="!!")), "kv_transfer_params_json.remote_agent_metadata"),
    (lambda h: json.dumps(dict(h, remote_lease=[4096, 0])), "kv_transfer_params_json.remote_lease"),
])
def test_a_bad_hand_off_is_invalid_argument_naming_the_field(stubs, clients, mutate, field):
    handoff = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "ninfer-x",
               "remote_agent_metadata": base64.b64encode(b"x").decode(), "remote_request_id": "r",
               "num_prompt_tokens": len(PROMPT), "remote_block_ids": [0, 1, 2, 3, 4],
               "remote_spans": [[4096, 4096, 2048]] * 2, "remote_lease": [4096, 1], "first_token_id": 1,
               "remote_state_slot": -1, "remote_state_spans": [], "remote_hidden_row": 0, "remote_hidden_spans": []}
    info = stubs["consumer"].GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert info.kv_role == "kv_consumer"
    # the consumer's own layout, so that only the mutated field is wrong
    own = json.loads(generate(stubs["producer"], kv=REMOTE_DECODE, max_tokens=1,
                              request_id=f"pd-bad-{field}").kv_transfer_params_json)
    handoff["remote_spans"], handoff["remote_hidden_spans"] = own["remote_spans"], own["remote_hidden_spans"]
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
            # the whole prompt was pulled, not recomputed
            assert cache_hits(clients["consumer"]) - hits == via_pd["usage"]["prompt_tokens"]
            events = list(pd.stream_completion(body))
            assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == alone["choices"][0]["text"]
            hits = cache_hits(clients["consumer"])
        for name in ("producer", "consumer"):
            assert wait_for(lambda: clients[name].metrics().queue.parked == 0), f"{name}: a lease still held"
            assert_nothing_held(clients[name])
    finally:
        pd.stop()
        single.stop()


@pytest.fixture(scope="module")
def hybrid():
    """The trained tiny Qwen3.5 hybrid with MTP: a producer and a consumer at k = 3, a single engine at k = 0."""
    model = require_shared_hybrid()
    started = []
    try:
        for role, k in (("producer", 3), ("consumer", 3), ("both", 0)):
            started.append(start_host(model, role, k))
        hosts = dict(zip(("producer", "consumer", "single"), started))
        channels = {name: grpc.insecure_channel(h.address) for name, h in hosts.items()}
        clients = {name: EngineClient(h.address) for name, h in hosts.items()}
        yield SimpleNamespace(model=model, hosts=hosts, clients=clients,
                              stubs={n: vllm_engine_pb2_grpc.VllmEngineStub(c) for n, c in channels.items()})
        for c in (*channels.values(), *clients.values()):
            c.close()
    finally:
        for h in started:
            h.stop()


def test_a_hybrid_s_state_and_mtp_row_move_whole_and_the_consumer_recomputes_nothing(hybrid):
    """The consumer decodes from the pulled KV, linear-attention state and MTP hidden row: its tokens are the
    single engine's (k = 3 against k = 0), its prefill computes nothing, and its drafts are the ones a single
    k = 3 engine makes over the same prompt (the same acceptance: the first draft read the moved row)."""
    stubs, clients = hybrid.stubs, hybrid.clients
    single = generate(stubs["single"], max_tokens=HYBRID_TOKENS)
    whole_k3 = generate(stubs["producer"], max_tokens=HYBRID_TOKENS, request_id="hy-whole")   # untagged: served whole
    assert list(whole_k3.output_ids) == list(single.output_ids)
    prefill = generate(stubs["producer"], kv=REMOTE_DECODE, max_tokens=1, request_id="hy")
    handoff = json.loads(prefill.kv_transfer_params_json)
    assert handoff["remote_state_slot"] >= 0 and handoff["remote_hidden_row"] >= 0
    assert len(handoff["remote_state_spans"]) >= 2 and len(handoff["remote_block_ids"]) == 5
    computed = prefill_computed(clients["consumer"])
    decode = generate(stubs["consumer"], kv=prefill.kv_transfer_params_json, max_tokens=HYBRID_TOKENS,
                      request_id="hy")
    assert list(decode.output_ids) == list(single.output_ids)
    assert decode.cached_tokens == len(PROMPT) and prefill_computed(clients["consumer"]) == computed
    assert (decode.spec_draft_tokens, decode.spec_accepted_tokens) == (
        whole_k3.spec_draft_tokens, whole_k3.spec_accepted_tokens) and decode.spec_accepted_tokens > 0
    assert wait_for(lambda: clients["producer"].metrics().queue.parked == 0), "notified: the lease ends"
    for name in ("producer", "consumer"):
        assert_nothing_held(clients[name])


def test_a_hybrid_pull_under_an_ended_lease_gives_slot_and_row_back_and_recomputes_exactly(hybrid):
    """The lease word covers the state slot and the hidden row too: the producer's lease ends (its parked
    request aborted, which zeroes the word before the request's blocks, slot and row are freed) before the
    consumer pulls, so the word read after the READ of blocks, slot and row is stale; the whole landing goes
    back unread and the consumer recomputes the prompt, its tokens the single engine's, nothing held after.
    (The dense pair's stale pull over reused blocks: test_pd_faults.py.)"""
    stubs, clients = hybrid.stubs, hybrid.clients
    single = generate(stubs["single"], max_tokens=HYBRID_TOKENS, request_id="hy-stale-alone")
    prefill = generate(stubs["producer"], kv=REMOTE_DECODE, max_tokens=1, request_id="hy-stale")
    handoff = json.loads(prefill.kv_transfer_params_json)
    assert handoff["remote_state_slot"] >= 0 and handoff["remote_hidden_row"] >= 0
    stubs["producer"].Abort(pb.AbortRequest(request_ids=[handoff["remote_request_id"]]), timeout=10)
    assert wait_for(lambda: clients["producer"].metrics().queue.parked == 0), "the abort ends the lease"
    stubs["consumer"].FlushCache(common_pb2.FlushCacheRequest(), timeout=10)   # no prefix hit to blur the count
    computed, hits = prefill_computed(clients["consumer"]), cache_hits(clients["consumer"])
    decode = generate(stubs["consumer"], kv=prefill.kv_transfer_params_json, max_tokens=HYBRID_TOKENS,
                      request_id="hy-stale")
    assert list(decode.output_ids) == list(single.output_ids)
    assert prefill_computed(clients["consumer"]) - computed == len(PROMPT), "recomputed, not decoded from the pull"
    assert cache_hits(clients["consumer"]) == hits and decode.cached_tokens == 0
    for name in ("producer", "consumer"):
        assert_nothing_held(clients[name])


@pytest.mark.skipif(smg_command() is None, reason="smg is not installed (the `test` extra installs it)")
def test_a_hybrid_through_smg_pd_decodes_a_single_engine_s_text_recomputing_nothing(hybrid, tmp_path):
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(os.path.join(hybrid.model, "tokenizer.json"))
    clients = hybrid.clients
    pd = SmgRouter.start_pd([hybrid.hosts["producer"].address], [hybrid.hosts["consumer"].address], hybrid.model,
                            tmp_path / "smg-pd.log")
    try:
        pd.wait_until_ready(workers=2, model=os.path.basename(hybrid.model), timeout_s=60)
        prompt = PREFIX + "alpha"
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        alone = generate(hybrid.stubs["single"], prompt=ids, max_tokens=HYBRID_TOKENS, request_id="hy-smg")
        body = {"model": os.path.basename(hybrid.model), "prompt": prompt, "max_tokens": HYBRID_TOKENS,
                "temperature": 0, "ignore_eos": True}
        hits, computed = cache_hits(clients["consumer"]), prefill_computed(clients["consumer"])
        via_pd = pd.completion(body)
        assert via_pd["usage"]["prompt_tokens"] == len(ids) > 16
        assert via_pd["choices"][0]["text"] == tokenizer.decode(list(alone.output_ids))
        assert cache_hits(clients["consumer"]) - hits == len(ids)
        assert prefill_computed(clients["consumer"]) == computed
        for name in ("producer", "consumer"):
            assert wait_for(lambda: clients[name].metrics().queue.parked == 0), f"{name}: a lease still held"
            assert_nothing_held(clients[name])
    finally:
        pd.stop()
