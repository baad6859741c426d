"""KV blocks lent across engines (prefill/decode disaggregation, docs/disaggregation.md). Torch-free.

Producer side, `lent_blocks`: the blocks of a parked (prefilled) request whose KV is final for a
consumer: the full blocks below the prompt's last token (registered in the prefix cache, so their
target and MTP entries are both written). The consumer recomputes the rest (under a block plus the
last token), which gives it the logits of the first token and the MTP hidden row, exactly as after
a prefix-cache hit.

Consumer side, a `KVLanding`: fresh blocks reserved for the pull, held by a pseudo-request under its
own id while the transfer runs (off the engine thread). `land` registers them in the prefix cache
under the prompt's block keys and drops the landing's hold in the same engine command that admits
the request, so its admission finds them as a prefix hit; `drop` gives them back after a failed pull.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.cache.block_manager import KVCacheManager

LANDING_PREFIX = "kv-landing:"


@dataclass
class KVLanding:
    """Blocks a consumer holds for KV on its way from a producer (a `KVRequest` of the KV manager)."""

    request_id: str                       # LANDING_PREFIX + the request's id
    token_ids: list[int]                  # the prompt: the landed blocks' prefix keys come from it
    num_blocks: int
    block_ids: list[int] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids


def lendable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Full blocks strictly below the prompt's last token: what a producer can lend for a prompt."""
    return max(num_prompt_tokens - 1, 0) // block_size


def lent_blocks(kv: KVCacheManager, req) -> list[int]:
    """The producer's lendable block ids of a parked request: full, registered (final) blocks only."""
    n = min(lendable_blocks(len(req.prompt_token_ids), kv.block_size), len(kv.block_keys(req)),
            len(req.block_ids))
    return list(req.block_ids[:n])


def reserve(kv: KVCacheManager, request_id: str, token_ids: list[int], num_blocks: int) -> KVLanding | None:
    """Fresh blocks for `num_blocks` of the prompt's leading blocks, or None when the pool has no room."""
    if not 0 < num_blocks <= lendable_blocks(len(token_ids), kv.block_size):
        raise ValueError(f"{num_blocks} blocks cannot land for a prompt of {len(token_ids)} tokens")
    landing = KVLanding(LANDING_PREFIX + request_id, list(token_ids), num_blocks)
    if not kv.allocate(landing, num_blocks * kv.block_size):
        return None
    return landing


def land(kv: KVCacheManager, landing: KVLanding) -> None:
    """The pulled blocks join the prefix cache (a block whose key another block holds stays unkeyed) and
    the landing lets go of them: they stay cached until a request claims or evicts them."""
    kv.register_blocks(landing, landing.num_blocks * kv.block_size)
    kv.free(landing)


def drop(kv: KVCacheManager, landing: KVLanding) -> None:
    """A pull that failed: its blocks go back to the free pool, unkeyed."""
    kv.free(landing)
