"""FIFO admission, one prefill lane, a continuous decode batch. Pure Python: counts tokens, not phases.

Every request wants its KV to catch up with its tokens: `num_tokens - num_computed_tokens` new
tokens, plus `k` draft slots while it decodes. A prefill chunk and a decode round are that one
thing at two sizes. The single asymmetry is the lane: prompts prefill in FIFO order, at most
`prefill_chunk` tokens per step shared by the prompts at the lane's front (`engine.sched.prefill_lane`),
while every running request advances one round per step, so a long prompt never stalls running
streams for more than one chunk.

Out of KV mid-decode: the newest running request is preempted (its blocks are freed, it goes back
to the head of the queue and is recomputed from prompt + outputs when blocks free up); streams
never see it except as a pause. A request alone always fits: admission refuses at the door any
prompt + max_tokens that exceeds the context limit or the whole KV capacity.

The prefill/decode split parks a prefilled request under a handle until a decode attaches. Parked
requests take no decode-batch seat: they hold their KV (which admission counts like any other) and
at most `max_parked` of them (parked + attached, waiting for a seat) exist at once; a request that
would park beyond that waits in the queue under the pending timeout. An attached request joins
the decode batch when a seat frees, ahead of new prefills. Both waits are bounded: a handle keeps
its lease only while no one needs its room (older than `handoff_timeout_s` it is dropped for a
queued request), and an attached request waits at most `seat_timeout_s` for a seat.

Hybrid models: a request also holds a linear-attention state slot (engine.cache.state_slots) from admission
to finish or preemption, and a prefix hit is used only up to a state snapshot (engine.cache.state_snapshots).
Their prompts pack in the lane like any other, each piece from its own slot (engine.sched.prefill_lane).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.sampling_params import TokenLogprob
from engine.sched.draft_policy import DraftPolicy
from engine.errors import InvalidArgumentError, QueueFullError, RequestNotFoundError
from engine.cache.block_manager import KVCacheManager
from engine.cache import kv_landing
from engine.sched.prefill_lane import ForkWork, PrefillLane, PrefillWork
from engine.sched.request import FinishReason, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.cache.state_slots import StateSlotPool
from engine.cache.state_snapshots import StateSnapshots


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int
    max_pending: int
    pending_timeout_s: float
    prefill_chunk: int
    draft_tokens: int              # engine-wide k; 0 = no speculation
    max_model_len: int
    lease_s: float = 60.0          # how long a parked prefill keeps its KV without a decode
    # a parked handle no decode attached within this long is dropped as soon as a queued request
    # needs its room (it keeps the whole lease only while no one waits for it)
    handoff_timeout_s: float = 5.0
    # an attached request that waits longer than this for a decode seat ends (a queue timeout); None: no bound
    seat_timeout_s: float | None = 60.0
    max_parked: int | None = None  # parked + attached-awaiting-a-seat at once; None = max_batch
    adaptive_draft: bool = False   # each round's k is picked in [0, draft_tokens] (engine.sched.draft_policy)


@dataclass
class DecodeWork:
    """One round for one running request: verify x_{n-1} plus k drafts, emit 1..k+1 tokens."""

    request_id: str
    last_token_id: int             # x_{n-1}, the one token whose target KV is not written yet
    num_tokens: int                # n
    num_mtp_computed: int          # m0: first MTP position whose entry is recomputed this round
    mtp_token_ids: list[int]       # x_{m0+1} .. x_{n-1}: the next token of each position recomputed
    block_ids: list[int]
    draft_tokens: int              # this request's drafts this round (<= its k <= the engine's)
    output_index: int
    sampling: SamplingParams
    seed: int
    state_slot: int = -1           # hybrids: the request's linear-attention state slot
    # Async scheduling (engine.worker.async_rounds): the row of the round before whose tokens this row adds on the
    # device (engine.worker.decode_round.carry_forward); num_tokens and output_index are then as they were
    # before that round, last_token_id and mtp_token_ids are unused, and that round adds at most
    # `carried_max` tokens.
    carry_row: int = -1
    carried_max: int = 0

    @property
    def max_num_tokens(self) -> int:
        """An upper bound of n for this round (exact unless carried)."""
        return self.num_tokens + self.carried_max


@dataclass
class SchedulerOutput:
    # One packed prefill chunk: pieces of several prompts in FIFO order (engine.sched.prefill_lane).
    prefills: list[PrefillWork]
    decode: list[DecodeWork]
    # Requests that left since the previous step: the runner drops any state it keeps for them.
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decode


@dataclass
class ModelOutput:
    # request id -> tokens this step produced (prefill: the first one; decode: accepted drafts + 1)
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # request id -> the logprobs of those tokens (requests with `logprobs` set), one per token
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # request id -> the logprobs of the prompt tokens this step's chunk scored (`prompt_logprobs`)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


@dataclass
class RequestEvent:
    request: Request
    new_token_ids: list[int]
    finished: bool
    logprobs: list[TokenLogprob] | None = None          # one per new token (requests that asked)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, clock: Callable[[], float] = time.monotonic,
                 states: StateSlotPool | None = None, snapshots: StateSnapshots | None = None):
        self.config = config
        self.kv = kv
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.lane = PrefillLane(config.prefill_chunk, config.draft_tokens, kv, clock, states, snapshots)
        self.running: list[Request] = []
        self.parked: dict[str, Request] = {}
        self.attached: deque[Request] = deque()       # resumed (decode attached), waiting for a seat
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._cascaded: list[Request] = []
        self._lease_deadline: dict[str, float] = {}
        self._parked_at: dict[str, float] = {}         # when each parked handle parked
        self._attached_at: dict[str, float] = {}       # when each attached request began to wait for a seat
        self.draft_policy = DraftPolicy(config.draft_tokens) if config.adaptive_draft else None
        # called with a request's id just before its blocks are freed (a producer's KV lease ends there:
        # engine.cache.kv_leases)
        self.on_free: Callable[[str], None] | None = None

    # hybrids: linear-attention state slots (held beside KV) and snapshots at block boundaries; the
    # lane owns them (it admits), the scheduler frees a request's slot with its KV
    @property
    def states(self) -> StateSlotPool | None:
        return self.lane.states

    @states.setter
    def states(self, pool: StateSlotPool | None) -> None:
        self.lane.states = pool

    @property
    def snapshots(self) -> StateSnapshots | None:
        return self.lane.snapshots

    # -- the door -------------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        n = len(req.prompt_token_ids)
        total = n + req.sampling.max_tokens
        if total > self.config.max_model_len:
            raise InvalidArgumentError(
                "max_tokens", f"prompt ({n} tokens) + max_tokens ({req.sampling.max_tokens}) = {total} exceeds "
                f"the context limit of {self.config.max_model_len} tokens")
        if total + self.config.draft_tokens > self.kv.capacity_tokens:
            raise InvalidArgumentError(
                "max_tokens", f"prompt ({n} tokens) + max_tokens ({req.sampling.max_tokens}) + draft slots "
                f"({self.config.draft_tokens}) exceeds the KV capacity of {self.kv.capacity_tokens} tokens")
        seqs = req.sampling.n
        if seqs > 1:
            # the prompt once; each sequence its outputs, draft slots and a copy of the prompt's last block
            need = n + seqs * (req.sampling.max_tokens + self.config.draft_tokens + self.kv.block_size)
            if need > self.kv.capacity_tokens:
                raise InvalidArgumentError(
                    "n", f"{seqs} sequences x (max_tokens {req.sampling.max_tokens} + draft slots "
                    f"{self.config.draft_tokens} + a block of {self.kv.block_size}) + the prompt ({n} tokens) = "
                    f"{need} tokens exceed the KV capacity of {self.kv.capacity_tokens} tokens")
        for member in (req, *req.forks):
            if member.request_id in self.requests:
                raise InvalidArgumentError("request_id", f"{member.request_id!r} is already in use")
        if len(self.waiting) >= self.config.max_pending:
            raise QueueFullError(f"the pending queue is full ({self.config.max_pending} requests)")
        # a resumed request's last token is "sampled" already: its KV is computed by the first decode
        # round, as after any round (the state a migrated stream had on its first engine)
        req.num_prefill_tokens = req.num_tokens - 1 if req.resuming else n
        self.requests[req.request_id] = req
        for child in req.forks:                     # held until the prefill of sequence 0 forks them
            child.status = RequestStatus.FORKING
            child.num_prefill_tokens = n
            self.requests[child.request_id] = child
        self.waiting.append(req)

    # -- one step -------------------------------------------------------------------------------

    def expire(self) -> list[Request]:
        """Finish queued requests past the pending timeout and parked ones past their lease."""
        now = self.clock()
        # only requests that never started: a preempted one is back in the queue but was admitted
        done = [r for r in self.waiting
                if r.times.prefill_start is None and now - r.times.arrival > self.config.pending_timeout_s]
        for req in done:
            self.waiting.remove(req)
            self._finish(req, FinishReason.QUEUE_TIMEOUT)
        for rid, deadline in list(self._lease_deadline.items()):
            if now > deadline:
                done.append(self.parked[rid])
                self._finish(self.parked[rid], FinishReason.LEASE_EXPIRED)
        done += self._drop_stale_handles(now)
        seat_timeout = self.config.seat_timeout_s
        if seat_timeout is not None:
            for req in [r for r in self.attached if now - self._attached_at[r.request_id] > seat_timeout]:
                done.append(req)
                self._finish(req, FinishReason.QUEUE_TIMEOUT)
        return done + self.take_cascaded()

    def take_cascaded(self) -> list[Request]:
        """Sequences finished because their sequence 0 finished before forking them."""
        cascaded, self._cascaded = self._cascaded, []
        return cascaded

    def _drop_stale_handles(self, now: float) -> list[Request]:
        """While the queue's head waits for room among the parked, drop the oldest handles that no
        decode attached within handoff_timeout_s (an abandoned handle never holds admission for a lease)."""
        dropped: list[Request] = []
        while self.waiting and self.parked and self._parks(self.waiting[0]) and not self._has_room(self.waiting[0]):
            rid = min(self.parked, key=self._parked_at.__getitem__)
            if now - self._parked_at[rid] <= self.config.handoff_timeout_s:
                break
            dropped.append(self.parked[rid])
            self._finish(self.parked[rid], FinishReason.LEASE_EXPIRED)
        return dropped

    def waits(self) -> dict[str, float]:
        """The longest wait now of a parked handle (for its decode) and of an attached request (for a seat)."""
        now = self.clock()
        return {"oldest_parked_s": max((now - t for t in self._parked_at.values()), default=0.0),
                "oldest_awaiting_seat_s": max((now - t for t in self._attached_at.values()), default=0.0)}

    def schedule(self) -> SchedulerOutput:
        k = self.config.draft_tokens
        while self.attached and len(self.running) < self.config.max_batch:
            req = self.attached.popleft()
            del self._attached_at[req.request_id]
            req.status = RequestStatus.RUNNING
            req.times.decode_start = self.clock()
            self.running.append(req)
        decode: list[DecodeWork] = []
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:      # preempted earlier in this loop
                continue
            while not self.kv.allocate(req, req.num_tokens + k):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                decode.append(self.decode_work(req))
        if self.draft_policy is not None and decode:
            k_round = self.draft_policy.choose(len(decode))
            for work in decode:
                work.draft_tokens = min(work.draft_tokens, k_round)
        prefills = self.lane.plan(self.waiting, self._has_room)
        for piece in prefills:
            req = self.requests[piece.request_id]
            if piece.sample and req.forks:
                self._fork(piece, req)
        return SchedulerOutput(prefills=prefills, decode=decode, finished_request_ids=self.take_finished_ids())

    def _fork(self, piece: PrefillWork, parent: Request) -> None:
        """Sequences 1..n-1 of `parent`, forked by its sampling chunk: each takes the full prompt blocks
        by reference and fresh blocks from the prompt's partial last block on (a copy of it), and is
        sampled from the same logits with its own seed. One that finds no KV (or state slot) now
        queues at the head and prefills on its own later (the prefix cache keeps most of the prompt)."""
        bs, k = self.kv.block_size, self.config.draft_tokens
        prompt = parent.num_prefill_tokens
        shared = prompt // bs
        tail = parent.block_ids[shared] if prompt % bs else None
        deferred: list[Request] = []
        for child in parent.forks:
            if child.finished:
                continue
            slot_ok = self.states is None or self.states.allocate(child)
            if slot_ok and self.kv.fork(parent, child, shared, prompt + k):
                child.status = RequestStatus.PREFILLING
                piece.forks.append(ForkWork(
                    request_id=child.request_id, seed=child.seed, block_ids=child.block_ids,
                    copy_block=(tail, child.block_ids[shared]) if tail is not None else None,
                    state_slot=child.state_slot))
                continue
            if slot_ok and self.states is not None:
                self.states.free(child)
            child.status = RequestStatus.WAITING
            child.park_after_prefill = False          # it decodes once prefilled: a decode may be attached already
            deferred.append(child)
        for child in reversed(deferred):
            self.waiting.appendleft(child)
        parent.forks = []
        piece.deferred = [c.request_id for c in deferred]

    def take_finished_ids(self) -> list[str]:
        """Requests that left since the last call (their runner state is dropped with the next round)."""
        finished, self._finished_ids = self._finished_ids, []
        return finished

    def update(self, out: SchedulerOutput, result: ModelOutput) -> list[RequestEvent]:
        now = self.clock()
        events: list[RequestEvent] = []
        spec = self.config.draft_tokens > 0
        for piece in out.prefills:
            req = self.requests[piece.request_id]
            end = piece.start + len(piece.token_ids)
            scored = result.prompt_logprobs.get(piece.request_id)
            if scored is not None:
                req.prompt_logprobs.extend(scored)
            if req.num_preemptions == 0:
                req.computed_prefill_tokens += len(piece.token_ids)
            req.num_computed_tokens = end
            req.num_mtp_computed = min(end, req.num_prefill_tokens - 1) if spec else 0
            if piece.sample:
                self.lane.done(req)
                if req.times.first_token is None:
                    req.times.first_token = now
                if req.park_after_prefill and req.num_preemptions == 0:
                    req.status = RequestStatus.PARKED
                    self.parked[req.request_id] = req
                    self._lease_deadline[req.request_id] = now + self.config.lease_s
                    self._parked_at[req.request_id] = now
                else:
                    req.status = RequestStatus.RUNNING
                    self.running.append(req)
                    if req.times.decode_start is None:
                        req.times.decode_start = now
                if req.resuming:              # its next token is known: the one its first engine sent last
                    req.resuming = False
                    events.append(RequestEvent(req, [], False))
                else:
                    events.append(self._append(req, result.sampled[req.request_id], now,
                                               result.logprobs.get(req.request_id)))
                    events.extend(self._forked(req, piece, result, now, spec))
            self._register(req, spec)
            if piece.snapshot_slot >= 0:
                keys, i = self.kv.block_keys(req), end // self.kv.block_size - 1
                self.snapshots.bind(piece.snapshot_slot, keys[i] if i < len(keys) else None)
        for work in out.decode:
            req = self.requests[work.request_id]
            tokens = result.sampled[work.request_id]
            if spec:
                accepted = len(tokens) - 1
                s = req.spec
                s.rounds += 1
                s.drafted += work.draft_tokens
                s.accepted += accepted
                for i in range(accepted):
                    s.accepted_per_position[i] += 1
                if self.draft_policy is not None:
                    self.draft_policy.observe(work.draft_tokens, accepted)
                req.num_mtp_computed = req.num_tokens - 1
            req.num_computed_tokens = req.num_tokens - 1 + len(tokens)
            events.append(self._append(req, tokens, now, result.logprobs.get(work.request_id)))
            if not req.finished:
                self._register(req, spec)
        return events

    def _forked(self, parent: Request, piece: PrefillWork, result: ModelOutput, now: float,
                spec: bool) -> list[RequestEvent]:
        """The sequences the parent's sampling chunk forked join it (decoding or parked), each with its
        first token; those deferred report an empty first output (every sequence has one this step)."""
        events = []
        for f in piece.forks:
            child = self.requests[f.request_id]
            child.times.prefill_start, child.times.first_token = parent.times.prefill_start, now
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_mtp_computed = parent.num_mtp_computed
            if parent.park_after_prefill and parent.num_preemptions == 0:
                child.status = RequestStatus.PARKED
                self.parked[child.request_id] = child
                self._lease_deadline[child.request_id] = now + self.config.lease_s
                self._parked_at[child.request_id] = now
            else:
                child.status = RequestStatus.RUNNING
                child.times.decode_start = now
                self.running.append(child)
            events.append(self._append(child, result.sampled[child.request_id], now,
                                       result.logprobs.get(child.request_id)))
            if not child.finished:
                self._register(child, spec)
        events.extend(RequestEvent(self.requests[rid], [], False) for rid in piece.deferred
                      if rid in self.requests)
        return events

    # -- caller actions -------------------------------------------------------------------------

    def finish(self, request_id: str, reason: FinishReason) -> Request:
        """End a request in any state (abort, stop string); its blocks are freed once."""
        req = self.requests.get(request_id)
        if req is None:
            raise RequestNotFoundError(f"no request {request_id!r}")
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self._finish(req, reason)
        return req

    def resume(self, request_id: str) -> Request:
        """A decode attached to a parked request: its lease ends and it joins the decode batch at the
        next step that has a seat (it stays PARKED, holding its KV, until then)."""
        req = self.parked.pop(request_id, None)
        if req is None:
            raise RequestNotFoundError(f"no parked request {request_id!r} (unknown, attached or expired)")
        del self._lease_deadline[request_id]
        del self._parked_at[request_id]
        self._attach(req, self.clock())
        return req

    def _attach(self, req: Request, now: float) -> None:
        """Wait for a decode seat (the seat timeout, seat_timeout_s, counts from `now`)."""
        self._attached_at[req.request_id] = now
        self.attached.append(req)

    def admit_pulled(self, req: Request, landing: kv_landing.KVLanding, first_token_id: int) -> RequestEvent:
        """A request whose prompt another engine prefilled (prefill/decode disaggregation): `add_request`
        queued it; its prompt's KV, state slot and hidden row landed whole. It takes them, counts its
        prompt as computed (cached: nothing is recomputed here) and waits for a decode seat like a resumed
        parked request, with the producer's first token appended (-> that token's event)."""
        self.waiting.remove(req)
        kv_landing.hand_over(self.kv, self.states, landing, req)
        now, n = self.clock(), len(req.prompt_token_ids)
        req.num_prefill_tokens = req.num_computed_tokens = req.num_cached_tokens = n
        req.num_mtp_computed = n - 1 if self.config.draft_tokens > 0 else 0
        req.times.prefill_start = req.times.first_token = now
        req.status = RequestStatus.PARKED
        self._attach(req, now)
        event = self._append(req, [first_token_id], now)
        if not req.finished:
            self._register(req, self.config.draft_tokens > 0)
        return event

    def is_unclaimed(self, request_id: str) -> bool:
        """A split request no decode has attached to: parked, or still queued or prefilling on its way
        to park (releasing it then ends it before it parks)."""
        req = self.requests.get(request_id)
        if req is None or not req.park_after_prefill or req.num_preemptions:
            return False
        return request_id in self.parked or req.status in (RequestStatus.WAITING, RequestStatus.PREFILLING)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.lane or self.running or self.attached)

    @property
    def has_leavers(self) -> bool:
        """Requests left since the last schedule: the runner has yet to drop their state."""
        return bool(self._finished_ids)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def has_timeouts(self) -> bool:
        """Requests whose pending timeout or lease may expire while nothing else happens."""
        return bool(self.parked or self.waiting or self.attached)

    def is_parked(self, request_id: str) -> bool:
        return request_id in self.parked

    # -- internals ------------------------------------------------------------------------------

    @staticmethod
    def _parks(r: Request) -> bool:
        return r.park_after_prefill and r.num_preemptions == 0

    @property
    def parked_room(self) -> int:
        """Requests that may still park or attach (--max-parked, else the decode batch): the bound that keeps an
        MTP hidden-state row for each of them (engine.worker.model_runner)."""
        return (self.config.max_parked or self.config.max_batch) - len(self.parked) - len(self.attached)

    def _has_room(self, req: Request) -> bool:
        """Room for the queue's head once prefilled: a request that will park needs room among the
        parked; one that will decode needs a seat. The lane's requests count where they are headed."""
        parks = self._parks

        def seats(r: Request) -> int:             # an n > 1 request's sequences all take one when it forks
            return 1 + len(r.forks)
        ahead = sum(seats(r) for r in self.lane.requests if parks(r) == parks(req))
        if parks(req):
            return ahead + seats(req) <= self.parked_room
        return len(self.running) + len(self.attached) + ahead + seats(req) <= self.config.max_batch

    def decode_work(self, req: Request) -> DecodeWork:
        """The request's next round, packed whole from what the host knows (every round of it read)."""
        return DecodeWork(
            request_id=req.request_id, last_token_id=req.last_token_id, num_tokens=req.num_tokens,
            num_mtp_computed=req.num_mtp_computed,
            mtp_token_ids=req.tokens_from(req.num_mtp_computed + 1) if self.config.draft_tokens else [],
            block_ids=req.block_ids,       # read within this step only: no copy per round
            draft_tokens=req.draft_tokens, output_index=req.num_output_tokens,
            sampling=req.sampling, seed=req.seed, state_slot=req.state_slot)

    def _append(self, req: Request, tokens: list[int], now: float,
                logprobs: list[TokenLogprob] | None = None) -> RequestEvent:
        """Append tokens one by one, stopping at EOS / a stop token id / max_tokens."""
        taken: list[int] = []
        if req.sampling.max_tokens == 0:             # scoring only: the prompt's logprobs, no token
            self._finish(req, FinishReason.LENGTH, now)
            return RequestEvent(req, [], True, [])
        for tok in tokens:
            req.output_token_ids.append(tok)
            taken.append(tok)
            if tok in req.stop_token_ids:
                self._finish(req, FinishReason.STOP, now)
                break
            if req.num_output_tokens >= req.sampling.max_tokens:
                self._finish(req, FinishReason.LENGTH, now)
                break
        return RequestEvent(req, taken, req.finished, logprobs[:len(taken)] if logprobs is not None else None)

    def _register(self, req: Request, spec: bool) -> None:
        final = min(req.num_computed_tokens, req.num_mtp_computed) if spec else req.num_computed_tokens
        self.kv.register_blocks(req, final)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = req.num_mtp_computed = 0
        req.num_prefill_tokens = req.num_tokens
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self._finished_ids.append(req.request_id)        # the runner's per-request state is stale

    def _finish(self, req: Request, reason: FinishReason, now: float | None = None) -> None:
        if req.finished:
            return
        for child in req.forks:                   # never forked: they end with it
            self._finish(child, reason, now)
            self._cascaded.append(child)
        req.forks = []
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.PARKED:
            if self.parked.pop(req.request_id, None) is None:
                self.attached.remove(req)
            self._lease_deadline.pop(req.request_id, None)
            self._parked_at.pop(req.request_id, None)
            self._attached_at.pop(req.request_id, None)
        elif req.status is RequestStatus.PREFILLING:
            self.lane.done(req)
        self._free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.times.finish = self.clock() if now is None else now
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    def _free(self, req: Request) -> None:
        """Everything the request holds: KV blocks, and its state slot on a hybrid model."""
        if self.on_free is not None:
            self.on_free(req.request_id)
        self.kv.free(req)
        if self.states is not None:
            self.states.free(req)
