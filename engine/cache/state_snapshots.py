"""Snapshots of the linear-attention state at block-aligned prompt positions, for prefix reuse. No torch.

A cached KV prefix is usable by a hybrid model only together with the linear layers' state at its
end. When a prefill chunk ends on a block boundary, the runner copies the request's state slot into
a snapshot slot; the snapshot is then keyed by the prefix-cache key of the block that ends there
(a hash chain over every token before the boundary and the one after it, engine.cache.block_manager), so it
matches exactly the prefixes whose KV blocks the cache hands out. A later request whose cached
prefix reaches such a block starts from the snapshot; past the last snapshotted block it recomputes
(its cached-token count says only what it really skipped).

Where snapshots are taken (engine.sched.scheduler): at every chunk end on a block boundary, and at the last
block boundary of each prompt (the scheduler ends a chunk there), so that a repeated prompt or a
shared system prompt needs at most one block plus its own tail. The pool is small and LRU: a
snapshot costs a whole request's state (engine.loading.hybrid_config.linear_state_bytes).
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    def __init__(self, first_slot: int, num_slots: int):
        """Snapshot slots are `first_slot .. first_slot + num_slots - 1` of the state cache."""
        self.num_slots = num_slots
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self._by_key: dict[bytes, int] = {}
        self._key_of: OrderedDict[int, bytes] = OrderedDict()    # bound slots, least recently used first
        self._reserved: set[int] = set()

    @property
    def num_bound(self) -> int:
        return len(self._key_of)

    def usable_prefix(self, keys: list[bytes]) -> tuple[int, int]:
        """(blocks, slot): the longest run of the leading cached blocks whose end has a snapshot, and
        that snapshot's slot; (0, -1) when none."""
        for n in range(len(keys), 0, -1):
            slot = self._by_key.get(keys[n - 1])
            if slot is not None:
                self._key_of.move_to_end(slot)
                return n, slot
        return 0, -1

    def reserve(self) -> int:
        """A slot for a snapshot about to be taken: a free one, else the least recently used one."""
        if self._free:
            slot = self._free.pop()
        elif self._key_of:
            slot, key = self._key_of.popitem(last=False)
            del self._by_key[key]
        else:
            return -1                       # every slot reserved by chunks in flight (one lane: never)
        self._reserved.add(slot)
        return slot

    def bind(self, slot: int, key: bytes | None) -> None:
        """The snapshot taken into `slot` is the state at the end of the block keyed `key` (None: drop it)."""
        self._reserved.discard(slot)
        if key is None or key in self._by_key:
            self._free.append(slot)
            return
        self._by_key[key] = slot
        self._key_of[slot] = key

    def clear(self) -> None:
        for slot in list(self._key_of):
            self._free.append(slot)
        self._key_of.clear()
        self._by_key.clear()
