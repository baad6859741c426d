"""Protobuf <-> engine domain objects. The only place that knows both shapes.

`stats_to_proto` and `stats_from_proto` are exact inverses over `engine.request_stats.RequestStats`, so a
number survives engine -> gateway -> client unchanged.
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidArgumentError
from engine.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams
from engine.request_stats import FinishReason, Rates, RequestStats, SpeculativeCounts, Timings, Usage
from ninfer.v1 import common_pb2, engine_info_pb2

# ninfer.v1's own defaults for unset fields (common.proto documents them): greedy, 64 tokens
DEFAULT_MAX_TOKENS = 64
DEFAULT_TEMPERATURE = 0.0

_FINISH_REASONS = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.QUEUE_TIMEOUT: common_pb2.FINISH_REASON_QUEUE_TIMEOUT,
    FinishReason.LEASE_EXPIRED: common_pb2.FINISH_REASON_LEASE_EXPIRED,
}
_FINISH_NAMES = {v: k for k, v in _FINISH_REASONS.items()}


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    return _FINISH_REASONS[reason]


def finish_reason_from_proto(value: int) -> FinishReason | None:
    return _FINISH_NAMES.get(value)


# -- sampling ---------------------------------------------------------------------------------------

def sampling_from_proto(p: common_pb2.SamplingParams, room: int | None = None) -> SamplingParams:
    """Validated engine params; unset optional fields keep the engine's defaults, except that an unset
    max_tokens is clamped to `room` (the tokens the context leaves after the prompt), so that a long
    prompt is not refused for a field its caller never set. Raises InvalidArgumentError naming the field."""
    if len(p.stop) > MAX_STOP_STRINGS:              # before copying a field that may hold millions
        raise InvalidArgumentError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(p.stop)}")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgumentError("stop_token_ids",
                                   f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(p.stop_token_ids)}")
    kwargs: dict[str, Any] = {}
    for name in ("max_tokens", "temperature", "top_p", "seed", "draft_tokens"):
        if p.HasField(name):
            kwargs[name] = getattr(p, name)
    kwargs.setdefault("temperature", DEFAULT_TEMPERATURE)
    if "max_tokens" not in kwargs:
        if room is not None and room < 1:
            raise InvalidArgumentError("prompt", "the prompt leaves no room for a token under the context limit")
        kwargs["max_tokens"] = DEFAULT_MAX_TOKENS if room is None else min(DEFAULT_MAX_TOKENS, room)
    return SamplingParams(top_k=p.top_k, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
                          ignore_eos=p.ignore_eos, **kwargs)


def token_ids_from_proto(ids, field: str, vocab_size: int) -> list[int]:
    """Token ids as a list, each in [0, vocab_size)."""
    out = list(ids)
    bad = next((t for t in out if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgumentError(field, f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return out


# -- per-request statistics -------------------------------------------------------------------------

def stats_to_proto(stats: RequestStats) -> common_pb2.RequestStats:
    u, t, r, spec = stats.usage, stats.timings, stats.rates, stats.speculative
    return common_pb2.RequestStats(
        usage=common_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                               cached_tokens=u.cached_tokens, computed_prefill_tokens=u.computed_prefill_tokens),
        timings=common_pb2.Timings(queue_seconds=t.queue, prefill_seconds=t.prefill, decode_seconds=t.decode,
                                   total_seconds=t.total, ttft_seconds=t.ttft),
        rates=common_pb2.Rates(prefill_tok_s=r.prefill_tok_s, decode_tok_s=r.decode_tok_s),
        speculative=common_pb2.SpeculativeStats(
            draft_tokens=spec.draft_tokens, rounds=spec.rounds, drafted=spec.drafted, accepted=spec.accepted,
            accepted_per_position=spec.accepted_per_position),
        prefill_chunk=stats.prefill_chunk, preemptions=stats.preemptions,
        finish_reason=finish_reason_to_proto(stats.finish_reason))


def stats_from_proto(p: common_pb2.RequestStats) -> RequestStats:
    u, t, spec = p.usage, p.timings, p.speculative
    return RequestStats(
        usage=Usage(u.prompt_tokens, u.computed_prefill_tokens, u.cached_tokens, u.completion_tokens),
        timings=Timings(t.queue_seconds, t.prefill_seconds, t.decode_seconds, t.total_seconds, t.ttft_seconds),
        rates=Rates(p.rates.prefill_tok_s, p.rates.decode_tok_s),
        speculative=SpeculativeCounts(spec.draft_tokens, spec.rounds, spec.drafted, spec.accepted,
                                      tuple(spec.accepted_per_position)),
        prefill_chunk=p.prefill_chunk, preemptions=p.preemptions,
        finish_reason=finish_reason_from_proto(p.finish_reason))


# -- engine snapshot --------------------------------------------------------------------------------

def metrics_to_proto(snapshot: dict[str, Any]) -> engine_info_pb2.EngineMetrics:
    """The engine's metrics snapshot (`EngineLoop.metrics()`)."""
    pb = engine_info_pb2
    return pb.EngineMetrics(
        history=_message(pb.MetricsHistory, snapshot["history"]),
        last=_message(pb.MetricsLast, snapshot["last"]),
        performance=_message(pb.MetricsPerformance, snapshot["performance"]),
        kv=_message(pb.KvCacheState, snapshot["kv"]),
        queue=_message(pb.QueueState, snapshot["queue"]))


def _message(cls, values: dict[str, Any]):
    """`cls(**values)` over the fields the message knows: a key the engine adds later is not an error."""
    fields = cls.DESCRIPTOR.fields_by_name
    return cls(**{k: v for k, v in values.items() if k in fields})
