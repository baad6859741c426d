"""Linear-attention state slots as the scheduler sees them: which request owns which slot. No torch.

A hybrid model's request holds, beside its KV blocks, one state slot (the same index in every
linear layer's pool, engine.worker.state_pool) from admission into the prefill lane until it finishes or
is preempted; the slot is freed exactly once, like a KV block. Slots are numbered 0 .. num_slots-1.
"""

from __future__ import annotations

from typing import Protocol


class SlotRequest(Protocol):
    request_id: str
    state_slot: int


class StateSlotPool:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError("the state pool needs at least one slot")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))      # pop() hands out the lowest first
        self._owner: dict[int, str] = {}
        # Lifetime counters (equal at idle).
        self.taken = 0
        self.dropped = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, req: SlotRequest) -> bool:
        """Give the request a slot; False (and nothing taken) when none is free."""
        if req.state_slot >= 0:
            raise RuntimeError(f"request {req.request_id} already holds state slot {req.state_slot}")
        if not self._free:
            return False
        slot = self._free.pop()
        self._owner[slot] = req.request_id
        req.state_slot = slot
        self.taken += 1
        return True

    def hand_over(self, src: SlotRequest, dst: SlotRequest) -> None:
        """`src`'s slot becomes `dst`'s (a KV landing's, once its request is admitted): no slot is freed."""
        slot = src.state_slot
        if slot < 0 or dst.state_slot >= 0 or self._owner.get(slot) != src.request_id:
            raise RuntimeError(f"state slot {slot} cannot pass from {src.request_id} to {dst.request_id}")
        self._owner[slot] = dst.request_id
        dst.state_slot, src.state_slot = slot, -1

    def free(self, req: SlotRequest) -> None:
        """Return the request's slot, if it holds one (idempotent per request)."""
        slot = req.state_slot
        if slot < 0:
            return
        if self._owner.get(slot) != req.request_id:
            raise RuntimeError(f"state slot {slot} freed twice or by a request that does not own it")
        del self._owner[slot]
        self._free.append(slot)
        req.state_slot = -1
        self.dropped += 1
