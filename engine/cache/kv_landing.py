"""KV blocks lent across engines (prefill/decode disaggregation, docs/disaggregation.md). Torch-free.

Producer side, `lent`: what a parked (prefilled) request lends a consumer: every block of its prompt
(the last one partial), its linear-attention state slot (hybrids, the state after the whole prompt),
its MTP hidden row (the last prompt position's hidden state, which the first draft reads) and the
first token it sampled. That is the whole state of a request that parked after its prefill.

Consumer side, a `KVLanding`: fresh blocks (and, for a whole hand-off, a state slot) reserved for the
pull, held by a pseudo-request under its own id while the transfer runs (off the engine thread).
- whole: `hand_over` gives the landed blocks and slot to the request in the engine command that admits
  it straight into the decode batch (`Scheduler.admit_pulled`): nothing of the prompt is recomputed.
- leading blocks only (a request that must compute its prompt, prompt_logprobs): `land` registers the
  full blocks below the last token in the prefix cache and drops the landing's hold in the command that
  admits the request, so its admission finds them as a prefix hit (it recomputes the rest).
`drop` gives everything back after a failed pull.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.cache.block_manager import KVCacheManager
from engine.cache.state_slots import StateSlotPool

LANDING_PREFIX = "kv-landing:"


@dataclass
class KVLanding:
    """Blocks a consumer holds for KV on its way from a producer (a `KVRequest` of the KV manager)."""

    request_id: str                       # LANDING_PREFIX + the request's id
    token_ids: list[int]                  # the prompt: the landed blocks' prefix keys come from it
    num_blocks: int
    block_ids: list[int] = field(default_factory=list)
    whole: bool = False                   # the request's whole state lands: it is admitted decoding
    state_slot: int = -1                  # hybrids, whole: the slot the producer's state lands in
    hidden_row: int = -1                  # MTP, whole: the runner's hidden-state row it lands in

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids


@dataclass(frozen=True)
class Lent:
    """What a parked request lends (a producer's side of a hand-off)."""

    block_ids: list[int]                  # every block of the prompt, the last one partial
    state_slot: int                       # -1: no linear-attention state (a dense model)
    first_token_id: int                   # the token its prefill sampled


def lands_whole(params) -> bool:
    """Whether a request pulled from a producer may decode from its whole state (engine.core.add_pulled): one
    sequence, no prompt logprobs and no first-token logprobs (a hand-off carries the token, not its logprobs)."""
    return params.n == 1 and params.prompt_logprobs is None and params.logprobs is None


def lendable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Full blocks strictly below the prompt's last token: what a consumer that recomputes the rest of
    the prompt can take as a prefix hit."""
    return max(num_prompt_tokens - 1, 0) // block_size


def prompt_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Blocks holding a prompt's KV (the last one partial): what a whole hand-off moves."""
    return -(-num_prompt_tokens // block_size)


def lent(kv: KVCacheManager, req) -> Lent:
    """What a parked request lends: its prompt's blocks, state slot and first token."""
    n = prompt_blocks(len(req.prompt_token_ids), kv.block_size)
    if len(req.block_ids) < n or len(req.output_token_ids) != 1:
        raise RuntimeError(f"request {req.request_id} is not a parked prefill ({len(req.block_ids)} blocks, "
                           f"{len(req.output_token_ids)} tokens out)")
    return Lent(list(req.block_ids[:n]), req.state_slot, req.output_token_ids[0])


def reserve(kv: KVCacheManager, request_id: str, token_ids: list[int], num_blocks: int,
            states: StateSlotPool | None = None, whole: bool = False) -> KVLanding | None:
    """Fresh blocks for `num_blocks` of the prompt's leading blocks (whole: every block of the prompt,
    and a state slot when `states` is given), or None when the pool has no room."""
    most = (prompt_blocks if whole else lendable_blocks)(len(token_ids), kv.block_size)
    if not 0 < num_blocks <= most or (whole and num_blocks != most):
        raise ValueError(f"{num_blocks} blocks cannot land for a prompt of {len(token_ids)} tokens")
    landing = KVLanding(LANDING_PREFIX + request_id, list(token_ids), num_blocks, whole=whole)
    if whole and states is not None and not states.allocate(landing):
        return None
    if not kv.allocate(landing, num_blocks * kv.block_size):
        if states is not None:
            states.free(landing)
        return None
    return landing


def hand_over(kv: KVCacheManager, states: StateSlotPool | None, landing: KVLanding, req) -> None:
    """A whole landing's blocks and state slot become the request's (no reference is taken or dropped)."""
    if req.block_ids or req.state_slot >= 0 or not landing.whole:
        raise RuntimeError(f"request {req.request_id} cannot take landing {landing.request_id}")
    req.block_ids.extend(landing.block_ids)
    landing.block_ids.clear()
    if states is not None and landing.state_slot >= 0:
        states.hand_over(landing, req)


def land(kv: KVCacheManager, landing: KVLanding) -> None:
    """The pulled blocks join the prefix cache (a block whose key another block holds stays unkeyed) and
    the landing lets go of them: they stay cached until a request claims or evicts them."""
    kv.register_blocks(landing, landing.num_blocks * kv.block_size)
    kv.free(landing)


def drop(kv: KVCacheManager, landing: KVLanding, states: StateSlotPool | None = None) -> None:
    """A pull that failed: its blocks go back to the free pool, unkeyed, and its state slot to its pool."""
    kv.free(landing)
    if states is not None:
        states.free(landing)
