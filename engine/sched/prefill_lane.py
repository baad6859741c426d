"""The one prefill lane, packed: waiting prompts share a step's chunk of `prefill_chunk` tokens.

The lane stays one FIFO line. Each step hands out the chunk's token budget in order: first to the
requests already in the lane (a prompt that spans several chunks continues before anyone behind
it), then, while budget and batch seats remain, to the queue's head, admitted one by one (no
overtaking: the head that does not fit in the KV stops admission, as before; so does a head whose
next prompt block a request in the lane is computing right now: it waits one chunk and takes that
block from the prefix cache instead of computing it twice). The pieces become one
forward over several sequences (`engine.worker.forward_context` takes varlen batches). Eight 512-token
prompts arriving together thus prefill in two steps of a 2048-token chunk instead of eight, and each
still has its own prefill start (admission) and first token (the step that ends its prompt).

Hybrid models (linear-attention layers: `states` given) pack the same way: each prompt holds a
state slot from admission (no free slot stops admission, like no KV), a prefix hit is trimmed to a
state snapshot that its first chunk restores, and a chunk ending on a block boundary saves a
snapshot. In the forward each piece's linear-attention layers run from its own slot (the conv
window and recurrent state of that prompt alone); the runner restores every piece's snapshot before
the forward and saves snapshots after it, so a snapshot saved in a step is never one restored in
it: a prompt that could hit it is computing the same blocks and waits (`_awaits_shared_prefix`).

Pure Python, no torch: the scheduler owns the lane; the runner only sees `PrefillWork`s.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.cache.block_manager import KVCacheManager
from engine.sched.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.cache.state_slots import StateSlotPool
from engine.cache.state_snapshots import StateSnapshots


@dataclass(frozen=True)
class SampleHistory:
    """What a prefill's sample needs of its request when its logit options read the history: the
    prompt and the outputs so far (after a preemption), its stop token ids and bad words."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_token_ids: frozenset[int]
    bad_words_token_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class ForkWork:
    """Sequence `index` > 0 of an n > 1 request, forked by its sequence 0's sampling chunk: the same
    last hidden state, sampled with its own seed; KV of the shared prompt blocks by reference, the
    prompt's partial last block copied into its own."""

    request_id: str
    seed: int
    block_ids: list[int]
    copy_block: tuple[int, int] | None      # (sequence 0's partial last prompt block, this one's copy)
    state_slot: int = -1                    # hybrids: its linear-attention slot (a copy of sequence 0's)


@dataclass
class PrefillWork:
    """One chunk of one request's prefill: the tokens at positions [start, start + len(token_ids))."""

    request_id: str
    token_ids: list[int]
    start: int
    # Tokens at positions start+1 .. : the MTP pass reads x_{t+1} for position t. One shorter than
    # token_ids when the chunk ends the prefill (that token is sampled by this very step).
    next_token_ids: list[int]
    block_ids: list[int]
    sample: bool                   # the chunk ends the prefill: sample a token
    output_index: int              # index of that token among the request's outputs (RNG counter)
    sampling: SamplingParams
    seed: int
    state_slot: int = -1           # hybrids: the request's linear-attention state slot
    # hybrids: the first chunk after a prefix hit starts from the state snapshot in this slot
    restore_slot: int = -1
    # hybrids: the chunk ends on a block boundary; copy the state there into this snapshot slot
    snapshot_slot: int = -1
    # the sampling chunk of a request with logit options (engine.worker.logit_options): its history
    history: SampleHistory | None = None
    # score the prompt tokens after this chunk's positions, with this many alternatives (prompt_logprobs)
    prompt_logprobs: int | None = None
    # n > 1: the sequences this sampling chunk forks (engine.sched.scheduler.Scheduler._fork)
    forks: list[ForkWork] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)    # sequences that found no KV: queued to prefill alone


class PrefillLane:
    def __init__(self, chunk: int, draft_tokens: int, kv: KVCacheManager, clock: Callable[[], float],
                 states: StateSlotPool | None = None, snapshots: StateSnapshots | None = None):
        self.chunk = chunk                 # tokens per step, shared by every request of the step
        self.draft_tokens = draft_tokens
        self.kv = kv
        self.clock = clock
        self.states = states               # hybrids: linear-attention state slots, held beside KV
        self.snapshots = snapshots         # hybrids with prefix reuse: states at block boundaries
        self._restore: dict[str, int] = {} # request id -> snapshot slot its first chunk starts from
        self.requests: list[Request] = []  # admitted, prompt not fully computed, in FIFO order

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, req: Request) -> bool:
        return any(r is req for r in self.requests)

    def plan(self, waiting: deque[Request], has_room: Callable[[Request], bool]) -> list[PrefillWork]:
        """This step's pieces, FIFO, at most `chunk` tokens in all; admits from `waiting` while the
        budget lasts and `has_room(head)` says the head has a place to go once prefilled (a decode
        seat, or room among the parked; the scheduler counts the lane's requests)."""
        budget = self.chunk
        works: list[PrefillWork] = []
        for req in self.requests:
            if budget == 0:
                return works
            works.append(self._work(req, budget))
            budget -= len(works[-1].token_ids)
        while budget > 0 and waiting:
            req = waiting[0]
            if not has_room(req) or self._awaits_shared_prefix(req) or not self._admit(req):
                break
            waiting.popleft()
            works.append(self._work(req, budget))
            budget -= len(works[-1].token_ids)
        return works

    def done(self, req: Request) -> None:
        """The request's prompt is computed (or it ended): it leaves the lane."""
        self.requests = [r for r in self.requests if r is not req]
        self._restore.pop(req.request_id, None)

    def _awaits_shared_prefix(self, req: Request) -> bool:
        """A request in the lane is computing the next block of `req`'s prompt (a duplicate or an
        extension sent together): `req` waits for it to be cached rather than computing it twice."""
        if not (req.prefix_cache and self.kv.prefix_reuse):
            return False
        tokens = req.all_token_ids[:req.num_prefill_tokens]
        bs = self.kv.block_size
        end = (self.kv.find_prefix(tokens).num_tokens // bs + 1) * bs + 1    # the next block and the token after it
        if end > len(tokens):
            return False
        return any(r.num_computed_tokens < end and r.all_token_ids[:end] == tokens[:end] for r in self.requests)

    def _admit(self, req: Request) -> bool:
        """Give the queue's head its cached prefix and blocks for the whole prompt, or nothing
        (hybrids: and a state slot; their hit ends at a state snapshot, which the first chunk restores)."""
        if self.states is not None and self.states.num_free == 0:
            return False
        found: list[int] = []

        def up_to_a_snapshot(keys: list[bytes]) -> int:
            blocks, slot = self.snapshots.usable_prefix(keys)
            found.append(slot)
            return blocks
        hit = self.kv.admit(req, req.all_token_ids[:req.num_prefill_tokens],
                            req.num_prefill_tokens + self.draft_tokens, reuse=req.prefix_cache,
                            trim=up_to_a_snapshot if self.snapshots is not None else None)
        if hit is None:
            return False
        if hit.num_tokens and self.snapshots is not None:
            self._restore[req.request_id] = found[-1]
        if self.states is not None:
            self.states.allocate(req)
        req.num_computed_tokens = req.num_mtp_computed = hit.num_tokens
        if req.num_preemptions == 0:
            req.num_cached_tokens = hit.num_tokens
        if req.times.prefill_start is None:
            req.times.prefill_start = self.clock()
        req.status = RequestStatus.PREFILLING
        self.requests.append(req)
        return True

    def _work(self, req: Request, budget: int) -> PrefillWork:
        start = req.num_computed_tokens
        end = min(start + budget, req.num_prefill_tokens)
        snapshot_slot = -1
        if self.snapshots is not None:
            # end a chunk at the prompt's last block boundary (the longest prefix a repeat can reuse)
            bs = self.kv.block_size
            last = (req.num_prefill_tokens - 1) // bs * bs
            if start < last < end:
                end = last
            if end % bs == 0 and end < req.num_prefill_tokens:
                snapshot_slot = self.snapshots.reserve()
        tokens = req.all_token_ids
        sample = end == req.num_prefill_tokens
        history = (SampleHistory(req.prompt_token_ids, list(req.output_token_ids), req.stop_token_ids,
                                 req.bad_words_token_ids) if sample and req.sampling.adjusts_logits else None)
        return PrefillWork(
            request_id=req.request_id, token_ids=tokens[start:end], start=start,
            next_token_ids=tokens[start + 1:end + (0 if sample else 1)], block_ids=list(req.block_ids),
            sample=sample, output_index=req.num_output_tokens, sampling=req.sampling, seed=req.seed,
            state_slot=req.state_slot, restore_slot=self._restore.pop(req.request_id, -1),
            snapshot_slot=snapshot_slot, history=history,
            # the first prefill only (a recompute after preemption covers outputs too, scored already)
            prompt_logprobs=req.sampling.prompt_logprobs if req.num_preemptions == 0 else None)
