"""Protobuf <-> engine domain objects. The only place that knows both shapes.

`stats_to_proto` and `stats_from_proto` are exact inverses over `engine.request_stats.RequestStats`, so a
number survives engine -> gateway -> client unchanged.
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidArgumentError
from engine.sampling_params import TokenLogprob
from engine.sampling_params import (MAX_BAD_WORDS, MAX_CHOICES, MAX_LOGIT_BIAS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                                    SamplingParams, StructuredOutput)
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
    """Validated engine params; unset optional fields keep this protocol's defaults (greedy, 64
    tokens), except that an unset max_tokens is clamped to `room` (the tokens the context leaves after
    the prompt), so that a long prompt is not refused for a field its caller never set. Raises
    InvalidArgumentError naming the field."""
    # sizes first, before copying a field that may hold millions
    for name, limit, what in (("stop", MAX_STOP_STRINGS, "stop strings"), ("stop_token_ids", MAX_STOP_TOKEN_IDS,
                              "stop token ids"), ("logit_bias", MAX_LOGIT_BIAS, "entries"), ("bad_words", MAX_BAD_WORDS, "words")):
        if len(getattr(p, name)) > limit:
            raise InvalidArgumentError(name, f"at most {limit} {what}, got {len(getattr(p, name))}")
    kwargs: dict[str, Any] = {}
    for name in ("max_tokens", "temperature", "top_p", "seed", "draft_tokens", "repetition_penalty", "logprobs",
                 "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens"):
        if p.HasField(name):
            kwargs[name] = getattr(p, name)
    kwargs.setdefault("temperature", DEFAULT_TEMPERATURE)
    if "max_tokens" not in kwargs:
        if room is not None and room < 1:
            raise InvalidArgumentError("prompt", "the prompt leaves no room for a token under the context limit")
        kwargs["max_tokens"] = DEFAULT_MAX_TOKENS if room is None else min(DEFAULT_MAX_TOKENS, room)
    return SamplingParams(
        top_k=p.top_k, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        n=p.n or 1, min_p=p.min_p, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        min_tokens=p.min_tokens, logit_bias=dict(p.logit_bias) or None, bad_words=list(p.bad_words) or None,
        include_stop_str_in_output=p.include_stop_str_in_output,
        structured_output=structured_output_from_proto(p.structured_output) if p.HasField("structured_output") else None,
        **kwargs)


def structured_output_from_proto(p: common_pb2.StructuredOutput) -> StructuredOutput:
    if len(p.choice) > MAX_CHOICES:
        raise InvalidArgumentError("structured_output.choice", f"at most {MAX_CHOICES} choices, got {len(p.choice)}")
    return StructuredOutput(
        json_schema=p.json_schema if p.HasField("json_schema") else None, json_object=p.json_object,
        regex=p.regex if p.HasField("regex") else None, grammar=p.grammar if p.HasField("grammar") else None,
        choice=tuple(p.choice) or None, structural_tag=p.structural_tag if p.HasField("structural_tag") else None)


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """The engine params as ninfer.v1 sends them (every field set explicitly)."""
    p = common_pb2.SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        stop=params.stop, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos, n=params.n,
        min_p=params.min_p, presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, min_tokens=params.min_tokens,
        logit_bias=params.logit_bias or {}, bad_words=params.bad_words or [],
        include_stop_str_in_output=params.include_stop_str_in_output, skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens)
    for name in ("seed", "draft_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
        if getattr(params, name) is not None:
            setattr(p, name, getattr(params, name))
    so = params.structured_output
    if so is not None:
        p.structured_output.CopyFrom(common_pb2.StructuredOutput(
            json_schema=so.json_schema, json_object=so.json_object, regex=so.regex, grammar=so.grammar,
            choice=so.choice or (), structural_tag=so.structural_tag))
    return p


# -- logprobs ---------------------------------------------------------------------------------------

def logprobs_to_proto(logprobs: list[TokenLogprob] | None) -> list[common_pb2.TokenLogprob]:
    return [common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                                    top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
            for lp in logprobs or ()]


def logprobs_from_proto(items) -> list[TokenLogprob]:
    return [TokenLogprob(lp.token_id, lp.logprob, lp.rank, tuple((t.token_id, t.logprob) for t in lp.top))
            for lp in items]


def sequence_output_to_proto(out) -> common_pb2.SequenceOutput:
    """One output of a request stream (`engine.loop.RequestStream`) as a SequenceOutput."""
    msg = common_pb2.SequenceOutput(index=out.index, token_ids=out.new_token_ids, finished=out.finished,
                                    logprobs=logprobs_to_proto(out.logprobs))
    if out.stats is not None:
        msg.stats.CopyFrom(stats_to_proto(out.stats))
    return msg


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
