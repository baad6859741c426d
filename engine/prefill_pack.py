"""The one prefill lane, packed: waiting prompts share a step's chunk of `prefill_chunk` tokens.

The lane stays one FIFO line. Each step hands out the chunk's token budget in order: first to the
requests already in the lane (a prompt that spans several chunks continues before anyone behind
it), then, while budget and batch seats remain, to the queue's head, admitted one by one (no
overtaking: the head that does not fit in the KV stops admission, as before; so does a head whose
next prompt block a request in the lane is computing right now: it waits one chunk and takes that
block from the prefix cache instead of computing it twice). The pieces become one
forward over several sequences (`engine.forward_context` takes varlen batches). Eight 512-token
prompts arriving together thus prefill in two steps of a 2048-token chunk instead of eight, and each
still has its own prefill start (admission) and first token (the step that ends its prompt).

Pure Python, no torch: the scheduler owns the lane; the runner only sees `PrefillWork`s.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams


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


class PrefillLane:
    def __init__(self, chunk: int, draft_tokens: int, kv: KVCacheManager, clock: Callable[[], float]):
        self.chunk = chunk                 # tokens per step, shared by every request of the step
        self.draft_tokens = draft_tokens
        self.kv = kv
        self.clock = clock
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
        """Give the queue's head its cached prefix and blocks for the whole prompt, or nothing."""
        hit = self.kv.admit(req, req.all_token_ids[:req.num_prefill_tokens],
                            req.num_prefill_tokens + self.draft_tokens, reuse=req.prefix_cache)
        if hit is None:
            return False
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
        tokens = req.all_token_ids
        sample = end == req.num_prefill_tokens
        return PrefillWork(
            request_id=req.request_id, token_ids=tokens[start:end], start=start,
            next_token_ids=tokens[start + 1:end + (0 if sample else 1)], block_ids=list(req.block_ids),
            sample=sample, output_index=req.num_output_tokens, sampling=req.sampling, seed=req.seed)
