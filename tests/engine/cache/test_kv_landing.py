"""engine.cache.kv_landing: what a producer lends (full, final blocks below the prompt's last token) and
how a consumer's landing turns pulled blocks into a prefix hit for the request, or gives them back."""

from __future__ import annotations

import pytest

from engine.cache import kv_landing
from engine.cache.block_manager import KVCacheManager
from tests.conftest import KVReq as Req

BS = 4


def idle(kv: KVCacheManager) -> bool:
    return kv.num_free_blocks == kv.num_blocks and kv.refs_taken == kv.refs_dropped


class Parked(Req):
    @property
    def prompt_token_ids(self) -> list[int]:
        return self.tokens


@pytest.mark.parametrize("prompt_len, lendable", [(1, 0), (4, 0), (5, 1), (8, 1), (9, 2), (10, 2)])
def test_a_producer_lends_the_full_blocks_below_the_last_prompt_token(prompt_len, lendable):
    assert kv_landing.lendable_blocks(prompt_len, BS) == lendable
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    req = Parked("p", list(range(prompt_len)))
    kv.allocate(req, prompt_len + 1)
    kv.register_blocks(req, prompt_len)
    assert kv_landing.lent_blocks(kv, req) == req.block_ids[:lendable]
    kv.register_blocks(req, 0)
    unregistered = Parked("q", list(range(prompt_len)))
    kv.allocate(unregistered, prompt_len + 1)                   # nothing final yet: nothing to lend
    assert kv_landing.lent_blocks(kv, unregistered) == []


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
