"""What the prefill/decode tests (tests/services/smg/test_pd.py, test_pd_faults.py) share: the prompt, one
leg over smg's engine protocol, and the check that an engine holds nothing after a request or a fault."""

from __future__ import annotations

import json

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from services.engine_client import EngineClient
from tests.support.polling import wait_for

PROMPT = list(range(300, 370))                   # 70 tokens: 5 blocks of 16 lent whole, the last one partial
REMOTE_DECODE = json.dumps({"do_remote_decode": True, "do_remote_prefill": False})   # smg's prefill-leg tag


def generate(stub, prompt=PROMPT, kv: str | None = None, max_tokens: int = 16, request_id: str = "pd-1",
             stream: bool = False, timeout_s: float = 60.0, **sampling) -> pb.GenerateComplete:
    """One greedy Generate (a leg when `kv` is a tag or a hand-off); streamed tokens land in output_ids."""
    request = pb.GenerateRequest(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=prompt),
                                 sampling_params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                   **sampling),
                                 stream=stream)
    if kv is not None:
        request.kv_transfer_params_json = kv
    responses = list(stub.Generate(request, timeout=timeout_s))
    output = [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids]
    done = responses[-1].complete
    if stream:
        done.output_ids.extend(output)
    return done


def assert_nothing_held(client: EngineClient, lease_s: float = 0.0) -> None:
    """No request anywhere (a parked one holds a lease: waited out for up to `lease_s` + 5 s), every block
    free, every reference dropped, no state slot or MTP hidden row taken."""
    assert wait_for(lambda: client.metrics().queue.parked == 0, lease_s + 5), "a lease is still held"
    m = client.wait_idle(timeout_s=10)
    assert (m.queue.waiting, m.queue.running, m.queue.parked) == (0, 0, 0), m.queue
    assert m.kv.free_blocks == m.kv.num_blocks, f"{m.kv.num_blocks - m.kv.free_blocks} blocks held"
    assert m.kv.refs_taken == m.kv.refs_dropped
    assert m.kv.state_slots_used == 0 and m.kv.mtp_hidden_rows_used == 0, m.kv


def leases_expired(client: EngineClient) -> int:
    """Parked requests the engine finished because no decode came within their lease."""
    return client.metrics().performance.requests.get("lease_expired", 0)
