"""A hand-off's byte count (what the producer logs as `kv_lent` bytes) is what a whole pull moves: the sizes of
the descriptors `remote_descs()` lists, for a hybrid with MTP (state and hidden spans) and a plain model."""

from __future__ import annotations

from engine.cache.kv_leases import KVLease
from services.kv_transfer.handoff import Handoff


def test_nbytes_is_the_sum_of_the_whole_pull_s_descriptors():
    spans = [(1 << 20, 4096, 2048), (1 << 21, 4096, 2048), (1 << 22, 512, 64)]
    whole = Handoff(engine_id="e", agent_metadata=b"m", request_id="r", num_prompt_tokens=70, block_ids=[3, 9, 4, 1],
                    spans=spans, lease=KVLease(8, 1), first_token_id=5, state_slot=2,
                    state_spans=[(1 << 23, 9000, 7000), (1 << 24, 300, 200)], hidden_row=6,
                    hidden_spans=[(1 << 25, 1536, 1536)])
    assert whole.nbytes == sum(n for _, n in whole.remote_descs()) == 4 * (2048 + 2048 + 64) + 7000 + 200 + 1536
    plain = Handoff(engine_id="e", agent_metadata=b"m", request_id="r", num_prompt_tokens=70, block_ids=[3, 9],
                    spans=spans, lease=KVLease(8, 1))
    assert plain.nbytes == sum(n for _, n in plain.remote_descs()) == 2 * (2048 + 2048 + 64)
