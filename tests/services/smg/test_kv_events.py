"""Prefix-cache events, pure Python: the KV manager tells its listeners about every block it makes
reusable (chained to its parent, with its tokens) and every one it evicts, and the smg publisher
numbers them for subscribers, replaying what a reconnecting subscriber missed."""

from __future__ import annotations

import asyncio
import threading

from tests.conftest import KVReq as Req
from engine.cache.block_manager import KVCacheManager
from services.smg.kv_events import KvEventPublisher, block_hash


class Recorder:
    def __init__(self):
        self.stored: list[tuple[bytes | None, list[bytes], list[list[int]]]] = []
        self.removed: list[bytes] = []

    def blocks_stored(self, parent, keys, tokens):
        self.stored.append((parent, list(keys), [list(t) for t in tokens]))

    def blocks_removed(self, keys):
        self.removed.extend(keys)


def run(kv: KVCacheManager, req: Req) -> None:
    assert kv.admit(req, req.tokens, len(req.tokens)) is not None
    kv.register_blocks(req, len(req.tokens))


def test_registered_blocks_are_announced_as_a_chain_with_their_tokens():
    kv, rec = KVCacheManager(num_blocks=8, block_size=4), Recorder()
    kv.listeners.append(rec)
    a = Req("a", range(100, 111))                   # 11 tokens: blocks 0 and 1 are final (the next token is known)
    run(kv, a)
    assert len(rec.stored) == 1
    parent, keys, tokens = rec.stored[0]
    assert parent is None and tokens == [list(range(100, 104)), list(range(104, 108))]
    assert keys == kv._keys["a"][:2]
    a.tokens += [111, 112]                          # decode completes block 2 (its next token 112 is known)
    kv.allocate(a, len(a.tokens))
    kv.register_blocks(a, len(a.tokens))
    assert rec.stored[1][0] == keys[1] and rec.stored[1][2] == [[108, 109, 110, 111]]
    kv.free(a)
    assert rec.removed == []                        # freed blocks stay cached: nothing is removed yet
    b = Req("b", range(100, 111))                   # a prefix hit registers nothing new
    run(kv, b)
    assert len(rec.stored) == 2
    kv.free(b)


def test_evicted_and_reset_blocks_are_announced_once():
    kv, rec = KVCacheManager(num_blocks=3, block_size=4), Recorder()
    kv.listeners.append(rec)
    a = Req("a", range(9))                          # two cached blocks
    run(kv, a)
    kv.free(a)
    stored_keys = rec.stored[0][1]
    c = Req("c", range(50, 61))                     # needs all 3 blocks: both cached ones are evicted
    assert kv.allocate(c, 11)
    assert sorted(rec.removed) == sorted(stored_keys)
    kv.free(c)
    d = Req("d", range(70, 79))
    run(kv, d)
    kv.free(d)
    kv.reset_prefix_cache()
    assert sorted(rec.removed[2:]) == sorted(rec.stored[-1][1])


async def collect(batches) -> list:
    return [b async for b in batches]


def test_publisher_numbers_batches_and_replays_after_a_cursor():
    pub = KvEventPublisher(block_size=4, clock=lambda: 1.5)
    pub.blocks_stored(None, [b"k1" * 8, b"k2" * 8], [[1, 2, 3, 4], [5, 6, 7, 8]])
    pub.blocks_stored(b"k2" * 8, [b"k3" * 8], [[9, 10, 11, 12]])
    pub.blocks_removed([b"k3" * 8])
    wanted = iter([True, True, True, False])
    got = asyncio.run(collect(pub.subscribe(1, wanted=lambda: next(wanted))))
    assert [b.sequence_number for b in got] == [2, 3]
    stored = got[0].events[0].stored
    assert stored.parent_block_hash == block_hash(b"k2" * 8) and stored.blocks[0].token_ids == [9, 10, 11, 12]
    assert stored.blocks[0].block_size == 4 and got[0].timestamp == 1.5
    assert list(got[1].events[0].removed.block_hashes) == [block_hash(b"k3" * 8)]
    assert block_hash(b"\xff" * 16) == -1           # int64 as the protocol carries it


def test_a_waiting_subscriber_gets_live_batches():
    pub = KvEventPublisher(block_size=4)
    stop = threading.Event()
    got = []

    async def subscribe():
        async for batch in pub.subscribe(0, wanted=lambda: not stop.is_set()):
            got.append(batch.sequence_number)
            if len(got) == 2:
                stop.set()

    t = threading.Thread(target=asyncio.run, args=(subscribe(),))
    t.start()
    pub.blocks_stored(None, [b"a" * 16], [[1, 2, 3, 4]])
    pub.blocks_removed([b"a" * 16])
    t.join(5)
    assert not t.is_alive() and got == [1, 2]
