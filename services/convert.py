"""Protobuf <-> engine domain objects. The only place that knows both shapes.

`stats_to_proto` and `stats_from_proto` are exact inverses over the layout of
`engine.metrics.request_stats`, so a number survives engine -> gateway -> client unchanged.
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidArgumentError
from engine.sampling_params import SamplingParams
from ninfer.v1 import common_pb2, engine_info_pb2

_FINISH_REASONS = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "queue_timeout": common_pb2.FINISH_REASON_QUEUE_TIMEOUT,
    "lease_expired": common_pb2.FINISH_REASON_LEASE_EXPIRED,
}
_FINISH_NAMES = {v: k for k, v in _FINISH_REASONS.items()}


def finish_reason_to_proto(reason: str | None) -> int:
    return _FINISH_REASONS[reason]


def finish_reason_from_proto(value: int) -> str | None:
    return _FINISH_NAMES.get(value)


# -- sampling ---------------------------------------------------------------------------------------

def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """Validated engine params; unset optional fields keep the engine's defaults.
    Raises InvalidArgumentError naming the field."""
    kwargs: dict[str, Any] = {}
    for name in ("max_tokens", "temperature", "top_p", "seed", "draft_tokens"):
        if p.HasField(name):
            kwargs[name] = getattr(p, name)
    return SamplingParams(top_k=p.top_k, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
                          ignore_eos=p.ignore_eos, **kwargs)


def sampling_to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
        stop=s.stop, stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos, draft_tokens=s.draft_tokens)


def token_ids_from_proto(ids, field: str, vocab_size: int) -> list[int]:
    """Token ids as a list, each in [0, vocab_size)."""
    out = list(ids)
    bad = next((t for t in out if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgumentError(field, f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return out


# -- per-request statistics -------------------------------------------------------------------------

def stats_to_proto(stats: dict[str, Any]) -> common_pb2.RequestStats:
    t, spec = stats["timings_seconds"], stats["speculative"]
    return common_pb2.RequestStats(
        usage=common_pb2.Usage(prompt_tokens=stats["prompt_tokens"], completion_tokens=stats["completion_tokens"],
                               cached_tokens=stats["cached_tokens"],
                               computed_prefill_tokens=stats["computed_prefill_tokens"]),
        timings=common_pb2.Timings(queue_seconds=t["queue"], prefill_seconds=t["prefill"],
                                   decode_seconds=t["decode"], total_seconds=t["total"], ttft_seconds=t["ttft"]),
        rates=common_pb2.Rates(prefill_tok_s=stats["prefill_tok_s"], decode_tok_s=stats["decode_tok_s"]),
        speculative=common_pb2.SpeculativeStats(
            draft_tokens=spec["draft_tokens"], rounds=spec["rounds"], drafted=spec["drafted"],
            accepted=spec["accepted"], accepted_per_position=spec["accepted_per_position"]),
        prefill_chunk=stats["prefill_chunk"], preemptions=stats["preemptions"],
        finish_reason=finish_reason_to_proto(stats["finish_reason"]))


def stats_from_proto(p: common_pb2.RequestStats) -> dict[str, Any]:
    u, t, spec = p.usage, p.timings, p.speculative
    return {
        "prompt_tokens": u.prompt_tokens,
        "computed_prefill_tokens": u.computed_prefill_tokens,
        "cached_tokens": u.cached_tokens,
        "completion_tokens": u.completion_tokens,
        "prefill_chunk": p.prefill_chunk,
        "preemptions": p.preemptions,
        "timings_seconds": {"queue": t.queue_seconds, "prefill": t.prefill_seconds, "decode": t.decode_seconds,
                            "total": t.total_seconds, "ttft": t.ttft_seconds},
        "prefill_tok_s": p.rates.prefill_tok_s,
        "decode_tok_s": p.rates.decode_tok_s,
        "speculative": {"draft_tokens": spec.draft_tokens, "rounds": spec.rounds, "drafted": spec.drafted,
                        "accepted": spec.accepted, "accepted_per_position": list(spec.accepted_per_position)},
        "finish_reason": finish_reason_from_proto(p.finish_reason),
    }


# -- engine snapshot --------------------------------------------------------------------------------

def metrics_to_proto(snapshot: dict[str, Any], refs: tuple[int, int]) -> engine_info_pb2.EngineMetrics:
    """`EngineMetrics.snapshot()` plus the KV manager's (refs_taken, refs_dropped)."""
    pb = engine_info_pb2
    return pb.EngineMetrics(
        history=_message(pb.MetricsHistory, snapshot["history"]),
        last=_message(pb.MetricsLast, snapshot["last"]),
        performance=_message(pb.MetricsPerformance, snapshot["performance"]),
        kv=_message(pb.KvCacheState, {**snapshot["kv"], "refs_taken": refs[0], "refs_dropped": refs[1]}),
        queue=_message(pb.QueueState, snapshot["queue"]))


def _message(cls, values: dict[str, Any]):
    """`cls(**values)` over the fields the message knows: a key the engine adds later is not an error."""
    fields = cls.DESCRIPTOR.fields_by_name
    return cls(**{k: v for k, v in values.items() if k in fields})
