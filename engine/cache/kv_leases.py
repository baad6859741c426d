"""A producer's leases on lent KV, as words a consumer reads back after its pull. Torch-free.

A producer lends a parked request's blocks under a lease (`--lease-seconds`); the consumer READs them
one-sidedly, and nothing in the READ itself can tell whether the lease still held while the bytes moved:
after the lease ends the request is freed and its blocks may be evicted and rewritten by another prompt
(docs/disaggregation.md, "Faults").

So each lease is a word in a small table the transfer engine registers beside the KV pool: opening a lease
writes a fresh epoch (unique for the table's life) into a free slot, and the lease's end - release,
expiry, a dropped handle, an abort - zeroes that slot *before* the request's blocks are freed, on the engine
thread. The hand-off carries the slot's address and the epoch; the consumer READs the KV, then (once that
READ is complete) READs the word. An unchanged word means the lease was held until after the last byte was
read, so no block could have been reused during the pull; anything else means the copy may be stale and the
consumer recomputes the prompt instead (services/smg/pd.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

LEASE_SLOTS = 4096           # leases open at once at most (parked requests are max_parked <= max_batch)


@dataclass(frozen=True)
class KVLease:
    """Where a consumer finds the lease's word in the producer's memory, and the value it must still hold."""

    address: int
    epoch: int


class KVLeaseTable:
    def __init__(self, slots: int = LEASE_SLOTS):
        self.words = np.zeros(slots, dtype=np.uint64)           # [slots] uint64, registered once; 0 = no lease
        self._free = list(range(slots - 1, -1, -1))
        self._slot_of: dict[str, int] = {}
        # epochs start from the clock so that a restarted producer never repeats one it handed out before
        self._next_epoch = (time.time_ns() & ((1 << 62) - 1)) | 1

    @property
    def region(self) -> tuple[int, int]:
        """(address, bytes) of the table, for the transfer engine to register."""
        return self.words.ctypes.data, self.words.nbytes

    def open(self, request_id: str) -> KVLease | None:
        """A lease for a parked request's lent blocks (the same one if it is open already); None when every
        slot is taken (the request then lends nothing: its consumer recomputes)."""
        slot = self._slot_of.get(request_id)
        if slot is None:
            if not self._free:
                return None
            slot = self._slot_of[request_id] = self._free.pop()
            self.words[slot] = self._next_epoch
            self._next_epoch += 1
        return KVLease(self.words.ctypes.data + slot * self.words.itemsize, int(self.words[slot]))

    def close(self, request_id: str) -> None:
        """The lease ends (call before the request's blocks are freed); unknown ids are ignored."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self.words[slot] = 0
            self._free.append(slot)

    @property
    def open_count(self) -> int:
        return len(self._slot_of)
