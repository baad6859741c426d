"""KVCacheManager, pure Python: all-or-nothing allocation, exactly-once frees (refs_taken ==
refs_dropped at idle), prefix keys that include the token after each block, shared blocks that are
freed only by their last holder, and LRU eviction of cached free blocks."""

from __future__ import annotations

import pytest

from tests.conftest import KVReq as Req
from engine.cache.block_manager import KVCacheManager


def idle(kv: KVCacheManager) -> bool:
    return kv.num_free_blocks == kv.num_blocks and kv.refs_taken == kv.refs_dropped


def test_allocation_is_all_or_nothing_and_frees_exactly_once():
    kv = KVCacheManager(num_blocks=4, block_size=16)
    a, b = Req("a", range(40)), Req("b", range(40))
    assert kv.allocate(a, 40) and len(a.block_ids) == 3 and kv.num_free_blocks == 1
    assert kv.allocate(a, 48) and len(a.block_ids) == 3                     # still fits in 3 blocks
    assert not kv.allocate(b, 17) and b.block_ids == [] and kv.num_free_blocks == 1   # needs 2: nothing taken
    assert kv.allocate(b, 16)
    assert kv.usage == 1.0 and kv.capacity_tokens == 64
    kv.free(a)
    kv.free(b)
    assert idle(kv) and kv.refs_taken == 4
    kv.free(a)                                        # idempotent per request: it holds nothing now
    assert kv.refs_dropped == 4


def test_a_block_cannot_be_freed_twice():
    kv = KVCacheManager(num_blocks=2, block_size=16)
    a = Req("a", range(10))
    kv.allocate(a, 10)
    stolen = list(a.block_ids)
    kv.free(a)
    a.block_ids = stolen
    with pytest.raises(RuntimeError, match="freed twice"):
        kv.free(a)


def register(kv, req, n_final=None):
    kv.register_blocks(req, len(req.tokens) if n_final is None else n_final)


def test_prefix_hit_needs_the_token_after_each_block():
    kv = KVCacheManager(num_blocks=16, block_size=16)
    base = list(range(100, 150))                                 # 50 tokens: blocks 0..2 full
    a = Req("a", base)
    assert kv.admit(a, base, 50) is not None
    register(kv, a)
    # the same 50 tokens: 3 full blocks; the last token after block 2 is known -> 48 cached
    assert kv.find_prefix(base).num_tokens == 48
    # ending exactly on a block boundary: the last block has no next token -> not reusable
    assert kv.find_prefix(base[:48]).num_tokens == 32
    assert kv.find_prefix(base[:49]).num_tokens == 48
    # a prompt equal up to token 32 but different at 32: block 1's key includes token 32 -> one block
    other = base[:32] + [7] + base[33:]
    assert kv.find_prefix(other).num_tokens == 16
    assert kv.find_prefix([1] + base[1:]).num_tokens == 0        # the chain starts at the first token


def test_only_final_positions_are_registered():
    kv = KVCacheManager(num_blocks=16, block_size=16)
    a = Req("a", range(64))
    kv.admit(a, a.tokens, 64)
    kv.register_blocks(a, 31)                                    # positions 0..30 final: one block
    assert kv.find_prefix(list(range(64))).num_tokens == 16
    kv.register_blocks(a, 64)
    assert kv.find_prefix(list(range(65))).num_tokens == 48      # block 3 would need token 64 in a


def test_shared_blocks_are_freed_by_their_last_holder_and_then_reclaimed():
    kv = KVCacheManager(num_blocks=8, block_size=16)
    prompt = list(range(40))
    a = Req("a", prompt)
    kv.admit(a, prompt, 41)
    register(kv, a)
    b = Req("b", prompt)
    hit = kv.admit(b, prompt, 41)
    assert hit.num_tokens == 32 and b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert kv.num_free_blocks == 8 - 4
    kv.free(a)
    assert kv.num_free_blocks == 8 - 3                           # a's shared blocks stay: b holds them
    shared = b.block_ids[:2]
    kv.free(b)
    assert idle(kv)
    # freed but cached: a third request takes the same blocks back
    c = Req("c", prompt)
    hit = kv.admit(c, prompt, 41)
    assert hit.num_tokens == 32 and hit.block_ids == shared
    kv.free(c)
    assert idle(kv)


def test_admission_counts_cached_free_blocks_it_would_reclaim():
    kv = KVCacheManager(num_blocks=4, block_size=16)
    prompt = list(range(50))
    a = Req("a", prompt)
    kv.admit(a, prompt, 50)                                     # 4 blocks
    register(kv, a)
    kv.free(a)
    b = Req("b", prompt)
    hit = kv.admit(b, prompt, 64)                               # 3 cached (free) + 1 new = 4 <= 4
    assert hit is not None and hit.num_tokens == 48 and len(b.block_ids) == 4
    c = Req("c", list(range(500, 520)))
    assert kv.admit(c, c.tokens, 20) is None and c.block_ids == []   # nothing left: refused, nothing taken
    kv.free(b)
    assert idle(kv)


def test_lru_eviction_and_reset():
    kv = KVCacheManager(num_blocks=4, block_size=16)
    p1, p2 = list(range(33)), list(range(1000, 1033))
    for rid, p in (("a", p1), ("b", p2)):
        r = Req(rid, p)
        kv.admit(r, p, 33)                                      # 3 blocks each; the pool has 4
        register(kv, r)
        kv.free(r)
    # b took the never-used block, then a's least recently freed ones (a frees its tail first, so its
    # first block goes last and survives); b's prefix is intact
    assert kv.find_prefix(p2).num_tokens == 32
    assert kv.find_prefix(p1).num_tokens == 16
    kv.reset_prefix_cache()
    assert kv.find_prefix(p2).num_tokens == 0 and idle(kv)


def test_prefix_reuse_off_shares_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=16, prefix_reuse=False)
    a = Req("a", range(40))
    kv.admit(a, a.tokens, 40)
    register(kv, a)
    assert kv.find_prefix(list(range(40))).num_tokens == 0
    kv.free(a)
    assert idle(kv)
