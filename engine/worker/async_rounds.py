"""Async scheduling: the host plans, packs and enqueues decode round N+1 while the GPU runs round N.

A synchronous step reads round N's tokens, updates the requests, then schedules and packs N+1: the
GPU waits for all of that (about 0.5 ms a round at qwen3-8b, batch 1; bench/results/2026-11-30-h200).
With async scheduling (the idea of vLLM's async scheduling and SGLang's overlap scheduler) a step

  1. plans round N+1 from the requests as they were before round N (`plan_ahead`): each row
     continues its row of round N, whose tokens the device adds itself (last token, n, output
     index and MTP window all follow from N's tokens: `engine.worker.decode_round.carry_forward`), so
     MTP's accepted length needs no host read; KV blocks grow ahead by the most round N can add;
  2. enqueues N+1 and the copy of its tokens into pinned memory (`TokenReadback`);
  3. then waits for round N's tokens and does its bookkeeping one round late: stop conditions,
     streaming, finishing (which frees KV once, as before).

A request that finishes in round N still has a row in N+1 (already enqueued): that row's tokens are
dropped. Its KV blocks are freed after round N's tokens are read, while N+1 may still write them;
that is safe because every later use of a freed block is enqueued after N+1 on the same stream, and
N+1 writes only positions past the request's last final (prefix-registered) block.

A request that round N may end by length sits round N+1 out and rejoins, packed whole, the round
after. So does a request under a grammar (structured output): its mask for N+1 depends on N's tokens,
which the host has not read when N+1 is packed; packed whole, its mask is filled from its matcher
before the round is enqueued (engine.structured.round_masks), and the other rows never wait for it. Rounds with prefill work, batch changes that add requests (admission, attach) and out-of-KV
(preemption) run synchronously: the step first lands the round in flight, then schedules as before.

Tensor parallelism: every rank's round is enqueued (one graph replay each, or each rank's thread for
an eager round) and rank 0's tokens are read; every rank keeps its own copy of the last tokens, equal
on all ranks because they sample from the same gathered logits. Hybrid models: a round steps each
row's linear-attention state in place in its slot, and a verify round commits the accepted prefix on
the device (`commit_linear_states`), so N+1 reads N's state in stream order like it reads N's KV; a
slot freed one round late is reused only by a prefill, which is enqueued after N+1 (snapshots for
prefix reuse are taken in prefill only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.sched.request import Request
from engine.sched.scheduler import DecodeWork, ModelOutput, Scheduler, SchedulerOutput
from engine.worker.decode_round import RoundOutput, read_round
from engine.worker.logprobs import RoundLogprobs


def why_synchronous(config: EngineConfig) -> str:
    """Why this engine schedules every round synchronously; "" when it overlaps decode rounds."""
    if not config.async_scheduling:
        return "--no-async-scheduling"
    return ""


class TokenReadback:
    """Pinned host buffers, used in turns of two, that a round's outputs are copied into without waiting."""

    def __init__(self, max_batch: int, width: int, device: torch.device):
        self._cuda = device.type == "cuda"
        self._buffers = [torch.empty(max_batch * width, dtype=torch.int64, pin_memory=self._cuda)
                         for _ in range(2)]
        self._logprob_buffers: dict[tuple[int, int], torch.Tensor] = {}     # (turn, part) -> flat buffer
        self._turn = 0

    def start(self, out: RoundOutput) -> tuple[RoundOutput, torch.cuda.Event | None]:
        """A round's outputs (device) -> (their host copy, an event set once it arrived)."""
        self._turn ^= 1
        tokens = out.tokens
        n, w = tokens.shape
        host = self._buffers[self._turn][:n * w].view(n, w)
        host.copy_(tokens, non_blocking=self._cuda)       # on the current stream of the tokens' device
        logprobs = None
        if out.logprobs is not None:
            logprobs = RoundLogprobs(*(self._copy(i, t) for i, t in enumerate(out.logprobs.tensors())))
        arrived = torch.cuda.current_stream(tokens.device).record_event() if self._cuda else None
        return RoundOutput(host, out.num_accepted, logprobs), arrived

    def _copy(self, part: int, t: torch.Tensor) -> torch.Tensor:
        buf = self._logprob_buffers.get((self._turn, part))
        if buf is None or buf.numel() < t.numel() or buf.dtype != t.dtype:
            buf = torch.empty(t.numel(), dtype=t.dtype, pin_memory=self._cuda)
            self._logprob_buffers[(self._turn, part)] = buf
        host = buf[:t.numel()].view(t.shape)
        host.copy_(t, non_blocking=self._cuda)
        return host


@dataclass
class InflightRound:
    """A decode round enqueued on the device whose tokens the host has not read yet."""

    sched: SchedulerOutput
    requests: list[Request]          # each row's request, as planned (an id may be reused after an abort)
    host: RoundOutput                # where its outputs arrive: tokens [rows, drafts+1] int64, logprobs
    arrived: torch.cuda.Event | None

    def result(self) -> ModelOutput:
        """Wait for the round's outputs. -> the sampled tokens (and logprobs) of every row."""
        if self.arrived is not None:
            self.arrived.synchronize()
        out = ModelOutput()
        read_round(self.sched.decode, self.host, out)
        return out

    def live(self, scheduler: Scheduler) -> SchedulerOutput:
        """The round's work for requests still running (not aborted or finished since it was planned)."""
        works = [w for w, req in zip(self.sched.decode, self.requests)
                 if scheduler.requests.get(w.request_id) is req and not req.finished]
        return SchedulerOutput(prefills=[], decode=works)


def plan_ahead(scheduler: Scheduler, inflight: InflightRound) -> SchedulerOutput | None:
    """Round N+1 while round N (in flight) is unread, or None when it must wait for N's tokens.

    A request in round N gets a carried row. One that round N may end by length sits N+1 out (its
    tokens do not depend on the batch it runs in); the round after packs it whole, as it does any
    running request whose rounds have all been read."""
    s = scheduler
    if s.waiting or s.lane or s.attached or inflight.sched.prefills:
        return None
    k = s.config.draft_tokens
    rows = {w.request_id: r for r, w in enumerate(inflight.sched.decode)}
    works: list[DecodeWork] = []
    for req in s.running:
        r = rows.get(req.request_id)
        if r is None or inflight.requests[r] is not req:           # every round of it was read
            if not s.kv.allocate(req, req.num_tokens + k):
                return None                                        # preemption decides synchronously
            works.append(s.decode_work(req))
            continue
        if req.grammar is not None:
            continue                    # its mask needs round N's tokens: it sits N+1 out (structured output)
        adds = inflight.sched.decode[r].draft_tokens + 1           # the most round N adds
        if req.num_output_tokens + adds >= req.sampling.max_tokens:
            continue                                               # N may end it by length
        if not s.kv.allocate(req, req.num_tokens + adds + k):
            return None
        works.append(DecodeWork(
            request_id=req.request_id, last_token_id=0, num_tokens=req.num_tokens,
            num_mtp_computed=req.num_tokens - 1 if k else 0, mtp_token_ids=[], block_ids=req.block_ids,
            draft_tokens=req.draft_tokens, output_index=req.num_output_tokens, sampling=req.sampling,
            seed=req.seed, state_slot=req.state_slot, carry_row=r, carried_max=adds))
    if not works:
        return None
    if s.draft_policy is not None:         # chosen before round N's acceptance is seen: one round stale
        k_round = s.draft_policy.choose(len(works))
        for w in works:
            w.draft_tokens = min(w.draft_tokens, k_round)
    return SchedulerOutput(prefills=[], decode=works, finished_request_ids=s.take_finished_ids())
