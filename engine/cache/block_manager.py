"""KV block accounting: a pool of fixed-size blocks, per-request block lists, and prefix reuse. No torch.

Prefix reuse: a full block is keyed by a hash chain over the tokens before it, its own tokens, and
the one token after it. That last token matters because the MTP layer's entry at a block's final
position is computed from the next token; with it in the key a shared block is exactly what the
request would have computed itself. A block is registered only once all of its positions are
final (target KV written, MTP entries recomputed from real hidden states).

Freed blocks keep their key and sit in an LRU free list: a later request with the same prefix
takes them back; an allocation that needs a block evicts the least recently freed one.
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Protocol


class KVRequest(Protocol):
    request_id: str
    block_ids: list[int]

    @property
    def all_token_ids(self) -> list[int]: ...


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    key: bytes | None = None                      # set once the block is registered for reuse


@dataclass
class PrefixHit:
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0


class KVEventListener(Protocol):
    """Told, on the engine thread, when a block becomes reusable and when it stops being so (keep it cheap)."""

    def blocks_stored(self, parent: bytes | None, keys: list[bytes], tokens: list[list[int]]) -> None: ...

    def blocks_removed(self, keys: list[bytes]) -> None: ...


def block_key(parent: bytes, tokens: list[int], next_token: int) -> bytes:
    payload = array.array("q", [*tokens, next_token]).tobytes()
    return hashlib.blake2b(parent + payload, digest_size=16).digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_reuse: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_reuse = prefix_reuse
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_key: dict[bytes, int] = {}
        self._keys: dict[str, list[bytes]] = {}        # request id -> keys of its leading full blocks
        # Lifetime counters: allocations and frees of block references (equal at idle).
        self.refs_taken = 0
        self.refs_dropped = 0
        self.listeners: list[KVEventListener] = []     # prefix-cache events (the smg KV-event stream)

    # -- capacity -------------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix reuse ---------------------------------------------------------------------------

    def find_prefix(self, token_ids: list[int]) -> PrefixHit:
        """Cached blocks that cover a prefix of `token_ids` (read only; `take_prefix` claims them)."""
        hit = PrefixHit()
        if not self.prefix_reuse:
            return hit
        parent, bs = b"", self.block_size
        for start in range(0, len(token_ids) - bs, bs):     # the token after the block must be known
            key = block_key(parent, token_ids[start:start + bs], token_ids[start + bs])
            block_id = self._by_key.get(key)
            if block_id is None:
                break
            hit.block_ids.append(block_id)
            parent = key
        hit.num_tokens = len(hit.block_ids) * bs
        return hit

    def admit(self, req: KVRequest, token_ids: list[int], num_slots: int, reuse: bool = True,
              trim: Callable[[list[bytes]], int] | None = None) -> PrefixHit | None:
        """Give a new request its cached prefix (unless `reuse` is off) plus fresh blocks for
        `num_slots` slots, or nothing. `trim(keys of the cached blocks)` -> how many leading ones to
        use (hybrids: up to a state snapshot)."""
        if req.block_ids:
            raise RuntimeError(f"request {req.request_id} already holds blocks")
        hit = self.find_prefix(token_ids) if reuse else PrefixHit()
        if trim is not None and hit.block_ids:
            del hit.block_ids[trim([self._blocks[b].key for b in hit.block_ids]):]
            hit.num_tokens = len(hit.block_ids) * self.block_size
        reclaimed = sum(self._blocks[b].ref_count == 0 for b in hit.block_ids)   # cached but free
        if self.blocks_for(num_slots) - len(hit.block_ids) + reclaimed > len(self._free):
            return None
        for block_id in hit.block_ids:
            self._ref(block_id)
        req.block_ids.extend(hit.block_ids)
        self._keys[req.request_id] = [self._blocks[b].key for b in hit.block_ids]
        self.allocate(req, num_slots)
        return hit

    def block_keys(self, req: KVRequest) -> list[bytes]:
        """Prefix keys of the request's leading registered blocks (in order)."""
        return self._keys.get(req.request_id, [])

    def register_blocks(self, req: KVRequest, num_final_tokens: int) -> None:
        """Make the request's full blocks below `num_final_tokens` reusable by later requests."""
        if not self.prefix_reuse:
            return
        keys = self._keys.setdefault(req.request_id, [])
        bs = self.block_size
        if min(num_final_tokens, len(req.block_ids) * bs) // bs <= len(keys):
            return                      # the common decode step: no block completed, no token list built
        tokens = req.all_token_ids
        limit = min(num_final_tokens, len(tokens) - 1, len(req.block_ids) * bs) // bs
        stored: list[int] = []                       # indices of the blocks registered now
        for i in range(len(keys), limit):
            parent = keys[-1] if keys else b""
            key = block_key(parent, tokens[i * bs:(i + 1) * bs], tokens[(i + 1) * bs])
            keys.append(key)
            block = self._blocks[req.block_ids[i]]
            if key not in self._by_key and block.key is None:
                block.key = key
                self._by_key[key] = block.block_id
                stored.append(i)
        if stored and self.listeners:
            self._publish_stored(keys, tokens, stored)

    # -- allocation -----------------------------------------------------------------------------

    def allocate(self, req: KVRequest, num_tokens: int) -> bool:
        """Grow the request's blocks to hold `num_tokens` slots; all or nothing."""
        need = self.blocks_for(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        for _ in range(need):
            block_id, _ = self._free.popitem(last=False)     # least recently freed first
            block = self._blocks[block_id]
            if block.key is not None:                        # evict its cached prefix
                del self._by_key[block.key]
                for listener in self.listeners:
                    listener.blocks_removed([block.key])
                block.key = None
            block.ref_count = 1
            self.refs_taken += 1
            req.block_ids.append(block_id)
        return True

    def fork(self, parent: KVRequest, child: KVRequest, shared_blocks: int, num_slots: int) -> bool:
        """Give `child` the parent's first `shared_blocks` blocks (one more reference each) and fresh
        blocks up to `num_slots` slots; all or nothing. (n > 1: the sequences of one prompt.)"""
        if child.block_ids:
            raise RuntimeError(f"request {child.request_id} already holds blocks")
        if self.blocks_for(num_slots) - shared_blocks > len(self._free):
            return False
        for block_id in parent.block_ids[:shared_blocks]:
            self._ref(block_id)
            child.block_ids.append(block_id)
        return self.allocate(child, num_slots)

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def free(self, req: KVRequest) -> None:
        """Drop every block reference the request holds, exactly once (idempotent per request)."""
        # Free the tail first so that the blocks of a shared prefix are evicted last.
        for block_id in reversed(req.block_ids):
            block = self._blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed twice")
            block.ref_count -= 1
            self.refs_dropped += 1
            if block.ref_count == 0:
                self._free[block_id] = None
        req.block_ids.clear()
        self._keys.pop(req.request_id, None)

    def _ref(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1
        self.refs_taken += 1

    def reset_prefix_cache(self) -> None:
        removed = []
        for key, block_id in list(self._by_key.items()):
            if self._blocks[block_id].ref_count == 0:
                self._blocks[block_id].key = None
                del self._by_key[key]
                removed.append(key)
        if removed:
            for listener in self.listeners:
                listener.blocks_removed(removed)

    def _publish_stored(self, keys: list[bytes], tokens: list[int], stored: list[int]) -> None:
        """Tell the listeners about newly registered blocks, one event per run of consecutive blocks
        (a run's parent is the key before it; a block whose key another block holds is not stored)."""
        bs = self.block_size
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            parent = keys[run[0] - 1] if run[0] > 0 else None
            for listener in self.listeners:
                listener.blocks_stored(parent, [keys[i] for i in run], [tokens[i * bs:(i + 1) * bs] for i in run])
