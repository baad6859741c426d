"""vLLM-protocol messages (smg_grpc_proto.vllm_engine_pb2) <-> ninfer's engine objects. The only
place that knows both shapes; no engine calls here."""

from __future__ import annotations

import datetime
from typing import Any

from engine.errors import InvalidArgumentError
from engine.engine_info import EngineInfo
from engine.sampling_params import SamplingParams
from engine.request_stats import RequestStats
from services.smg.engine_port import EngineFacts
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

DEFAULT_TEMPERATURE = 1.0        # the protocol's (and vLLM's, and OpenAI's) when the field is unset

# Fields ninfer cannot honour: refused with INVALID_ARGUMENT when set to anything but "off", so that
# a request never silently gets a different distribution than it asked for.
_OFF_VALUES = {"min_p": (0.0,), "frequency_penalty": (0.0,), "presence_penalty": (0.0,),
               "repetition_penalty": (0.0, 1.0), "min_tokens": (0,)}


def sampling_from_proto(p: pb.SamplingParams, prompt_len: int, info: EngineInfo) -> SamplingParams:
    """Validated engine params (InvalidArgumentError names the field). Unset `max_tokens` means "up to
    the context length", as in vLLM; unset `temperature` means 1.0."""
    for name, off in _OFF_VALUES.items():
        if getattr(p, name) not in off:
            raise InvalidArgumentError(f"sampling_params.{name}", f"is not supported by ninfer (got {getattr(p, name)!r})")
    for name in ("logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
        if p.HasField(name):
            raise InvalidArgumentError(f"sampling_params.{name}", "is not supported by ninfer")
    if p.n > 1:
        raise InvalidArgumentError("sampling_params.n", f"ninfer generates one sequence per request, got {p.n}")
    if p.WhichOneof("constraint") is not None:
        raise InvalidArgumentError(f"sampling_params.{p.WhichOneof('constraint')}",
                                   "structured output is not supported by ninfer")
    if p.logit_bias:
        raise InvalidArgumentError("sampling_params.logit_bias", "is not supported by ninfer")
    room = min(info.max_model_len, info.kv_capacity_tokens) - prompt_len
    max_tokens = p.max_tokens if p.HasField("max_tokens") else max(1, room)
    return SamplingParams(
        max_tokens=max_tokens, temperature=p.temperature if p.HasField("temperature") else DEFAULT_TEMPERATURE,
        top_p=p.top_p or 1.0, top_k=p.top_k, seed=p.seed if p.HasField("seed") else None, stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos)


def check_unsupported_inputs(request: pb.GenerateRequest) -> None:
    for name in ("mm_inputs", "media_refs", "kv_transfer_params"):
        if request.HasField(name):
            raise InvalidArgumentError(name, "is not supported by ninfer (text models, no PD transfer)")
    if request.extra_mm_inputs:
        raise InvalidArgumentError("extra_mm_inputs", "is not supported by ninfer")
    if request.HasField("kv_transfer_params_json"):
        raise InvalidArgumentError("kv_transfer_params_json", "is not supported by ninfer")
    if request.WhichOneof("input") is None:
        raise InvalidArgumentError("input", "a prompt is required (tokenized or text)")


# -- responses --------------------------------------------------------------------------------------

def chunk(token_ids: list[int], prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> pb.GenerateResponse:
    return pb.GenerateResponse(chunk=pb.GenerateStreamChunk(
        token_ids=token_ids, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        cached_tokens=cached_tokens))


def complete(output_ids: list[int], stats: RequestStats, matched_token_id: int | None) -> pb.GenerateResponse:
    """The final message. Usage, cached tokens and MTP acceptance fit the protocol's fields; the
    timings do not (they go in the trailer, see vllm_servicer)."""
    u, spec = stats.usage, stats.speculative
    done = pb.GenerateComplete(
        output_ids=output_ids, finish_reason=stats.finish_reason.value if stats.finish_reason else "stop",
        prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens,
        spec_accepted_tokens=spec.accepted, spec_draft_tokens=spec.drafted)
    if matched_token_id is not None:
        done.matched_token_id = matched_token_id
    return pb.GenerateResponse(complete=done)


def model_info(facts: EngineFacts, hf_config: dict[str, Any]) -> pb.GetModelInfoResponse:
    info = facts.info
    eos = list(info.eos_token_ids)
    path = facts.model_dir or info.model
    return pb.GetModelInfoResponse(
        model_path=path, is_generation=not info.embedding, max_context_length=info.max_model_len, vocab_size=info.vocab_size,
        supports_vision=False, served_model_name=info.model, tokenizer_path=path,
        model_type=hf_config.get("model_type") or "", architectures=hf_config.get("architectures") or [],
        eos_token_ids=eos, pad_token_id=_int(hf_config.get("pad_token_id"), eos[0] if eos else 0),
        bos_token_id=_int(hf_config.get("bos_token_id"), -1), max_req_input_len=info.max_model_len - 1)


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _queue(snapshot: dict[str, Any]) -> tuple[int, int]:
    """(running, waiting): a parked request holds KV and a seat like a running one."""
    q = snapshot["queue"]
    return q["running"] + q["prefilling"] + q["parked"], q["waiting"]


def active_requests(snapshot: dict[str, Any]) -> int:
    return sum(_queue(snapshot))


def scheduler_load(snapshot: dict[str, Any], facts: EngineFacts) -> pb.SchedulerLoad:
    running, waiting = _queue(snapshot)
    kv, h = snapshot["kv"], snapshot["history"]
    seconds = sum(h["interval_seconds"])
    computed, hits = sum(h["prefill_tokens"]), sum(h["cache_hit_tokens"])
    return pb.SchedulerLoad(
        dp_rank=0, num_running_reqs=running, num_waiting_reqs=waiting, num_total_reqs=running + waiting,
        num_used_tokens=(kv["num_blocks"] - kv["free_blocks"]) * kv["block_size"],
        max_total_num_tokens=kv["capacity_tokens"], token_usage=kv["usage"],
        gen_throughput=sum(h["decode_tokens"]) / seconds if seconds > 0 else 0.0,
        cache_hit_rate=hits / (computed + hits) if computed + hits else 0.0,
        utilization=running / facts.max_batch if facts.max_batch else 0.0, max_running_requests=facts.max_batch)


def loads(snapshot: dict[str, Any], facts: EngineFacts, version: str) -> pb.GetLoadsResponse:
    return pb.GetLoadsResponse(timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(), version=version,
                               dp_rank_count=1, loads=[scheduler_load(snapshot, facts)])
