"""engine.cache.kv_landing: what a producer lends (a parked request's blocks, state slot and first token),
how a consumer's whole landing becomes the request's, how a landing of leading blocks turns pulled blocks
into a prefix hit, and how either gives everything back."""

from __future__ import annotations

import pytest

from engine.cache import kv_landing
from engine.cache.block_manager import KVCacheManager
from engine.cache.state_slots import StateSlotPool
from tests.conftest import KVReq as Req

BS = 4


def idle(kv: KVCacheManager) -> bool:
    return kv.num_free_blocks == kv.num_blocks and kv.refs_taken == kv.refs_dropped


class Parked(Req):
    def __init__(self, rid: str, tokens: list[int], outputs: list[int] = ()):
        super().__init__(rid, tokens)
        self.output_token_ids, self.state_slot = list(outputs), -1

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.tokens


@pytest.mark.parametrize("prompt_len, lendable, blocks", [(1, 0, 1), (4, 0, 1), (5, 1, 2), (8, 1, 2), (9, 2, 3)])
def test_a_producer_lends_every_block_of_the_prompt_its_slot_and_first_token(prompt_len, lendable, blocks):
    assert kv_landing.lendable_blocks(prompt_len, BS) == lendable
    assert kv_landing.prompt_blocks(prompt_len, BS) == blocks
    kv, states = KVCacheManager(num_blocks=8, block_size=BS), StateSlotPool(2)
    req = Parked("p", list(range(prompt_len)), outputs=[7])
    kv.allocate(req, prompt_len + 1 + 3)                         # + the first token and draft slots
    states.allocate(req)
    lent = kv_landing.lent(kv, req)
    assert lent == kv_landing.Lent(req.block_ids[:blocks], req.state_slot, 7)
    with pytest.raises(RuntimeError):
        kv_landing.lent(kv, Parked("q", list(range(prompt_len))))    # not parked: no first token, no blocks


def test_a_whole_landing_becomes_the_request_s_and_holds_nothing_after():
    kv, states = KVCacheManager(num_blocks=8, block_size=BS), StateSlotPool(2)
    prompt = list(range(100, 110))                               # 10 tokens: 3 blocks, the last one partial
    with pytest.raises(ValueError):
        kv_landing.reserve(kv, "r1", prompt, 2, states, whole=True)     # whole means every block
    landing = kv_landing.reserve(kv, "r1", prompt, 3, states, whole=True)
    blocks, slot = list(landing.block_ids), landing.state_slot
    assert len(blocks) == 3 and slot >= 0 and states.num_free == 1
    req = Parked("r1", prompt)
    kv_landing.hand_over(kv, states, landing, req)
    assert (req.block_ids, req.state_slot) == (blocks, slot) and landing.block_ids == [] and landing.state_slot == -1
    kv_landing.drop(kv, landing, states)                         # a landing handed over holds nothing
    assert kv.num_free_blocks == 5 and states.num_free == 1
    kv.free(req)
    states.free(req)
    assert idle(kv) and states.num_free == 2 and states.taken == states.dropped == 1


def test_a_whole_landing_without_a_free_slot_is_none_and_takes_no_block():
    kv, states = KVCacheManager(num_blocks=8, block_size=BS), StateSlotPool(1)
    states.allocate(Parked("hog", [0]))
    assert kv_landing.reserve(kv, "r1", list(range(9)), 3, states, whole=True) is None
    assert idle(kv)


def test_landed_blocks_are_the_next_request_s_prefix_hit_and_nothing_stays_held():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(100, 111))                               # 11 tokens: 2 lendable blocks
    landing = kv_landing.reserve(kv, "r1", prompt, 2)
    pulled_into = list(landing.block_ids)
    assert len(pulled_into) == 2 and kv.num_free_blocks == 6
    kv_landing.land(kv, landing)
    assert idle(kv)                                              # cached, not held
    req = Req("r1", prompt)
    hit = kv.admit(req, prompt, len(prompt) + 1)
    assert hit.block_ids == pulled_into and hit.num_tokens == 8
    kv.free(req)
    assert idle(kv)


def test_a_dropped_landing_gives_its_blocks_back_unkeyed():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(9))
    landing = kv_landing.reserve(kv, "r1", prompt, 2)
    kv_landing.drop(kv, landing)
    assert idle(kv) and kv.find_prefix(prompt).num_tokens == 0


def test_no_room_is_none_and_more_blocks_than_the_prompt_lends_is_refused():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    hog = Req("hog", [0] * 8)
    kv.allocate(hog, 8)
    assert kv_landing.reserve(kv, "r1", list(range(9)), 2) is None
    kv.free(hog)
    with pytest.raises(ValueError):
        kv_landing.reserve(kv, "r1", list(range(8)), 2)          # 8 tokens lend 1 block
    assert idle(kv)


@pytest.mark.parametrize("max_tokens, stops", [(4, False), (1, False), (4, True)])
def test_a_request_admitted_over_a_whole_landing_decodes_from_its_first_token(max_tokens, stops):
    """Scheduler.admit_pulled: the request takes the landed blocks and slot, counts its prompt as cached
    and computed (no prefill piece), starts with the producer's token, waits for a seat, and decodes with
    its MTP entries computed to the prompt's last position; at its end everything is free once."""
    from tests.conftest import make_request, make_scheduler, model_step
    sched = make_scheduler(num_blocks=8, block_size=BS, draft_tokens=3)
    sched.states = StateSlotPool(2)
    prompt = list(range(100, 110))
    req = make_request(prompt=prompt, max_tokens=max_tokens, stop_token_ids=[9] if stops else [])
    req.stop_token_ids = frozenset([9] if stops else [])
    landing = kv_landing.reserve(sched.kv, req.request_id, prompt, 3, sched.states, whole=True)
    sched.add_request(req)
    event = sched.admit_pulled(req, landing, 9 if stops else 5)
    assert event.new_token_ids == [9 if stops else 5] and req.num_cached_tokens == len(prompt)
    assert req.computed_prefill_tokens == 0 and not sched.waiting
    if max_tokens == 1 or stops:
        assert event.finished and not sched.requests
    else:
        out = sched.schedule()
        assert not out.prefills and [w.request_id for w in out.decode] == [req.request_id]
        assert out.decode[0].num_mtp_computed == len(prompt) - 1 and out.decode[0].mtp_token_ids == [5]
        assert out.decode[0].state_slot == req.state_slot >= 0
        while sched.has_work:
            model_step(sched, out)
            out = sched.schedule()
        assert req.output_token_ids == [5, 7, 7, 7]
    assert idle(sched.kv) and sched.states.num_free == 2 and sched.states.taken == sched.states.dropped == 1
