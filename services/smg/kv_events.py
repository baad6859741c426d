"""Prefix-cache events for smg's event-driven cache-aware routing (SubscribeKvEvents).

The KV manager calls this publisher (a `KVEventListener`) on the engine thread when full blocks
become reusable and when they are evicted; every call becomes one numbered `KvEventBatch`, kept in
a bounded history so that a subscriber that reconnects with its last sequence number gets what it
missed, and one that starts at 0 gets every batch still held (the cache as the engine built it).

Block hashes: smg's index takes `block_hash` as an opaque chain hash (what `parent_block_hash` and
`KvBlocksRemoved` refer to) and hashes each block's `token_ids` itself for lookups, block by block
over a request's tokens at the block size learned from the events (kv_index::compute_content_hash,
lightseekorg/smg model_gateway/src/core/kv_event_monitor.rs). Ours is the KV manager's own key
(blake2b over the parent key, the block's tokens and the token after it), its first 8 bytes read as
a signed little-endian int64; `token_ids` are the block's `block_size` tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from smg_grpc_proto.generated import common_pb2

HISTORY_BATCHES = 16384          # batches kept for replay (a reconnecting subscriber's gap)
WAIT_S = 0.5                     # how often a waiting subscriber checks that it is still wanted


def block_hash(key: bytes) -> int:
    """The KV manager's block key as the protocol's int64 block hash."""
    return int.from_bytes(key[:8], "little", signed=True)


class KvEventPublisher:
    def __init__(self, block_size: int, history: int = HISTORY_BATCHES, clock: Callable[[], float] = time.time):
        self.block_size = block_size
        self._clock = clock
        self._cond = threading.Condition()
        self._history: deque[common_pb2.KvEventBatch] = deque(maxlen=history)
        self._sequence = 0
        self._event_id = 0
        self._waiters: set[asyncio.Future] = set()       # subscribers waiting for a batch (on their loops)

    @property
    def sequence_number(self) -> int:
        return self._sequence

    # -- KVEventListener (engine thread) ----------------------------------------------------------

    def blocks_stored(self, parent: bytes | None, keys: list[bytes], tokens: list[list[int]]) -> None:
        stored = common_pb2.KvBlocksStored(
            blocks=[common_pb2.KvBlock(block_hash=block_hash(k), token_ids=t, block_size=self.block_size)
                    for k, t in zip(keys, tokens)],
            tier=common_pb2.KV_CACHE_TIER_DEVICE, medium="GPU", locality=common_pb2.KV_CACHE_LOCALITY_LOCAL)
        if parent is not None:
            stored.parent_block_hash = block_hash(parent)
        self._publish(lambda event: event.stored.CopyFrom(stored))

    def blocks_removed(self, keys: list[bytes]) -> None:
        removed = common_pb2.KvBlocksRemoved(block_hashes=[block_hash(k) for k in keys],
                                             tier=common_pb2.KV_CACHE_TIER_DEVICE, medium="GPU")
        self._publish(lambda event: event.removed.CopyFrom(removed))

    def _publish(self, fill: Callable[[common_pb2.KvCacheEvent], None]) -> None:
        with self._cond:
            self._sequence += 1
            self._event_id += 1
            event = common_pb2.KvCacheEvent(event_id=self._event_id)
            fill(event)
            self._history.append(common_pb2.KvEventBatch(sequence_number=self._sequence, timestamp=self._clock(),
                                                         events=[event], dp_rank=0))
            waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            try:
                waiter.get_loop().call_soon_threadsafe(_wake, waiter)
            except RuntimeError:                 # that subscriber's loop is closed
                pass

    # -- subscribers (the server's event loop) ----------------------------------------------------

    async def subscribe(self, start_sequence_number: int,
                        wanted: Callable[[], bool]) -> AsyncIterator[common_pb2.KvEventBatch]:
        """Batches numbered above `start_sequence_number` that are still held, then live ones, while
        `wanted()` (the call is active and the server not draining). A cursor older than the history
        resumes at the oldest batch held (smg then sees a gap it cannot fill: HISTORY_BATCHES bounds it)."""
        after = start_sequence_number
        while wanted():
            waiter = None
            with self._cond:
                if self._sequence <= after:
                    waiter = asyncio.get_running_loop().create_future()
                    self._waiters.add(waiter)
            if waiter is not None:
                try:
                    await asyncio.wait_for(waiter, WAIT_S)
                except TimeoutError:
                    pass
                finally:
                    with self._cond:
                        self._waiters.discard(waiter)
            with self._cond:
                first = self._history[0].sequence_number if self._history else after + 1
                batches = list(itertools.islice(self._history, max(0, after + 1 - first), None))
            for batch in batches:
                yield batch
                after = batch.sequence_number


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
