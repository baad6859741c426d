"""A request's state as the scheduler sees it. No torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.sampling_params import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.request_stats import FinishReason, Rates, RequestStats, SpeculativeCounts, Timings, Usage, rate

__all__ = ["FinishReason", "PhaseTimes", "Request", "RequestStatus", "SpecStats"]


class RequestStatus(enum.Enum):
    FORKING = "forking"          # sequence i > 0 of an n > 1 request, until the prefill of sequence 0 forks it
    WAITING = "waiting"          # in the FIFO pending queue
    PREFILLING = "prefilling"    # in the prefill lane
    PARKED = "parked"            # prefilled; KV held under a handle until a decode attaches
    RUNNING = "running"          # in the decode batch
    FINISHED = "finished"


@dataclass
class PhaseTimes:
    """Wall-clock instants (monotonic seconds) of one request's phases."""

    arrival: float
    prefill_start: float | None = None      # first chunk scheduled: the queue wait ends here
    first_token: float | None = None        # first token sampled: prefill ends here
    decode_start: float | None = None       # decode begins (= first_token unless parked)
    finish: float | None = None


@dataclass
class SpecStats:
    """Speculative counts of one request; see `engine.worker.sampler.verify` for the definitions."""

    draft_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seed: int                                # resolved: the caller's or a random one
    times: PhaseTimes
    draft_tokens: int = 0                    # this request's k (<= the engine's)
    park_after_prefill: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    state_slot: int = -1                     # hybrids: linear-attention state slot (-1 = none held)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # Tokens whose target-model KV is final, and positions whose MTP-layer KV is final.
    num_computed_tokens: int = 0
    num_mtp_computed: int = 0
    num_cached_tokens: int = 0               # prompt tokens taken from the prefix cache
    computed_prefill_tokens: int = 0         # prompt tokens this request's prefill computed
    # Tokens the current prefill covers: the prompt, or prompt + outputs after a preemption.
    num_prefill_tokens: int = 0
    num_preemptions: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    stop_token_ids: frozenset[int] = frozenset()
    prefix_cache: bool = True                # may take cached prefix blocks (off when scoring every position)
    # Resumed from another engine (a migrated stream) with output_token_ids already generated: its
    # first prefill covers all but the last of them and samples nothing (scheduler.update).
    resuming: bool = False
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()   # engine.sched.admission.bad_words_token_ids
    # prompt_logprobs: one per prompt token after the first, filled as the prefill's chunks score them
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # n > 1: the request's sequences are requests of their own. Sequence 0 prefills; its last prefill
    # chunk forks the others (`forks`, FORKING until then), which share its prompt's KV blocks.
    group_id: str = ""                       # the id the caller knows (this request's own when n = 1)
    index: int = 0                           # which of the n sequences
    forks: list["Request"] = field(default_factory=list)
    # structured output: the sequence's grammar matcher (engine.structured.matcher.GrammarState), advanced
    # by the engine as tokens are appended; None when unconstrained
    grammar: object | None = None

    def __post_init__(self) -> None:
        if not self.group_id:
            self.group_id = self.request_id

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_from(self, start: int) -> list[int]:
        """all_token_ids[start:] without building the whole list (decode steps of long contexts)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:]
        return self.prompt_token_ids[start:] + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def stats(self, prefill_chunk: int) -> RequestStats:
        """This request's figures as they stand now (finished, or parked after its prefill)."""
        req = self
        t = req.times
        end = t.finish if t.finish is not None else t.arrival
        first = t.first_token if t.first_token is not None else end
        start = t.prefill_start if t.prefill_start is not None else end
        decode_start = t.decode_start if t.decode_start is not None else first
        started = t.first_token is not None
        timings = Timings(
            queue=max(0.0, start - t.arrival),
            prefill=max(0.0, first - start),
            decode=max(0.0, end - decode_start) if started and t.finish is not None else 0.0,
            total=max(0.0, end - t.arrival),
            ttft=max(0.0, first - t.arrival) if started else 0.0)
        completion = req.num_output_tokens
        spec = req.spec
        return RequestStats(
            usage=Usage(len(req.prompt_token_ids), req.computed_prefill_tokens, req.num_cached_tokens, completion),
            timings=timings,
            rates=Rates(rate(req.computed_prefill_tokens, timings.prefill), rate(completion - 1, timings.decode)),
            speculative=SpeculativeCounts(spec.draft_tokens, spec.rounds, spec.drafted, spec.accepted,
                                          tuple(spec.accepted_per_position)),
            prefill_chunk=prefill_chunk, preemptions=req.num_preemptions, finish_reason=req.finish_reason)
