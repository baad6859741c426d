"""A request's figures, defined once: `RequestStats` and `FinishReason`. No torch.

Rates come from each request's own phase wall-clock, never from sampling windows:
    prefill_tok_s = computed_prefill_tokens / timings.prefill
    decode_tok_s  = (completion_tokens - 1) / timings.decode
Every report derives from this one object, each in one place: protobuf (`services.convert`), span
attributes and the `request_done` log (`services.server.telemetry`), Prometheus (`services.server.prometheus`),
JSON output of the CLI and the bench (`RequestStats.to_dict`).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any


class FinishReason(str, enum.Enum):
    STOP = "stop"                # EOS, a stop token id or a stop string
    LENGTH = "length"            # max_tokens reached
    ABORT = "abort"              # cancelled by the caller
    QUEUE_TIMEOUT = "queue_timeout"
    LEASE_EXPIRED = "lease_expired"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    computed_prefill_tokens: int         # prompt tokens the prefill computed (P of the prefill rate)
    cached_tokens: int                   # prompt tokens taken from the prefix cache
    completion_tokens: int


@dataclass(frozen=True)
class Timings:
    """Seconds of each phase, from the engine's own clock."""

    queue: float                         # arrival -> first prefill chunk scheduled
    prefill: float                       # first chunk -> first token sampled
    decode: float                        # decode start -> finish
    total: float                         # arrival -> finish
    ttft: float                          # arrival -> first token


@dataclass(frozen=True)
class Rates:
    prefill_tok_s: float
    decode_tok_s: float


@dataclass(frozen=True)
class SpeculativeCounts:
    """Counts of one request's draft+verify rounds; `engine.worker.sampler.verify` defines the terms."""

    draft_tokens: int                    # this request's k
    rounds: int
    drafted: int
    accepted: int
    accepted_per_position: tuple[int, ...]

    @property
    def acceptance_per_position(self) -> tuple[float, ...]:
        return tuple(n / self.rounds for n in self.accepted_per_position) if self.rounds else ()


@dataclass(frozen=True)
class RequestStats:
    """Made by `engine.sched.request.Request.stats()`."""

    usage: Usage
    timings: Timings
    rates: Rates
    speculative: SpeculativeCounts
    prefill_chunk: int                   # a prefill rate means nothing without its chunk size
    preemptions: int
    finish_reason: FinishReason | None   # None while the request runs (a parked prefill's stats)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (the CLI's --json line and the bench's raw records)."""
        d = dataclasses.asdict(self)
        d["finish_reason"] = self.finish_reason.value if self.finish_reason else None
        d["speculative"]["accepted_per_position"] = list(self.speculative.accepted_per_position)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RequestStats":
        """The inverse of `to_dict`."""
        spec = dict(d["speculative"], accepted_per_position=tuple(d["speculative"]["accepted_per_position"]))
        return cls(Usage(**d["usage"]), Timings(**d["timings"]), Rates(**d["rates"]), SpeculativeCounts(**spec),
                   d["prefill_chunk"], d["preemptions"],
                   FinishReason(d["finish_reason"]) if d["finish_reason"] else None)


def rate(tokens: int, seconds: float) -> float:
    """tokens / seconds of one request's own phase; 0 when either is 0."""
    return tokens / seconds if seconds > 0 and tokens > 0 else 0.0
