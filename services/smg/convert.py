"""vLLM-protocol messages (smg_grpc_proto.vllm_engine_pb2) <-> ninfer's engine objects. The only
place that knows both shapes; no engine calls here."""

from __future__ import annotations

import datetime
from typing import Any

from engine.errors import InvalidArgumentError
from engine.engine_info import EngineInfo
from engine.sampling_params import TokenLogprob
from engine.sampling_params import (MAX_LOGIT_BIAS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams,
                                    StructuredOutput)
from engine.request_stats import RequestStats
from services.smg.engine_port import EngineFacts
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

DEFAULT_TEMPERATURE = 1.0        # the protocol's (and vLLM's, and OpenAI's) when the field is unset


def sampling_from_proto(p: pb.SamplingParams, prompt_len: int, info: EngineInfo) -> SamplingParams:
    """Validated engine params (InvalidArgumentError names the field, `sampling_params.<name>`). Unset
    `max_tokens` means "up to the context length", as in vLLM; unset `temperature` means 1.0;
    `max_tokens` 0 scores the prompt (its logprobs, with `logprobs` alternatives)."""
    for name, limit in (("stop", MAX_STOP_STRINGS), ("stop_token_ids", MAX_STOP_TOKEN_IDS),
                        ("logit_bias", MAX_LOGIT_BIAS)):
        if len(getattr(p, name)) > limit:
            raise InvalidArgumentError(f"sampling_params.{name}", f"at most {limit} entries, got {len(getattr(p, name))}")
    room = min(info.max_model_len, info.kv_capacity_tokens) - prompt_len
    max_tokens = p.max_tokens if p.HasField("max_tokens") else max(1, room)
    logprobs = p.logprobs if p.HasField("logprobs") else None
    prompt_logprobs = p.prompt_logprobs if p.HasField("prompt_logprobs") else None
    if max_tokens == 0 and prompt_logprobs is None:         # echo + max_tokens 0: what is asked is the prompt's
        prompt_logprobs = logprobs if logprobs is not None else 0
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=p.temperature if p.HasField("temperature") else DEFAULT_TEMPERATURE,
            top_p=p.top_p or 1.0, top_k=p.top_k, min_p=p.min_p, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty or 1.0,
            seed=p.seed & (2**63 - 1) if p.HasField("seed") else None, stop=list(p.stop),
            stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos, min_tokens=p.min_tokens,
            n=p.n or 1, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            logit_bias=dict(p.logit_bias) or None, include_stop_str_in_output=p.include_stop_str_in_output,
            skip_special_tokens=p.skip_special_tokens, spaces_between_special_tokens=p.spaces_between_special_tokens,
            truncate_prompt_tokens=p.truncate_prompt_tokens if p.HasField("truncate_prompt_tokens") else None,
            structured_output=structured_output(p))
    except InvalidArgumentError as e:
        raise protocol_error(e) from None


def protocol_error(e: InvalidArgumentError) -> InvalidArgumentError:
    """An engine refusal of a sampling field, named as this protocol names it (`sampling_params.<field>`)."""
    if e.field.split(".")[0] not in SamplingParams.__dataclass_fields__:
        return e
    return InvalidArgumentError(f"sampling_params.{e.field}", str(e)[len(e.field) + 2:])


def structured_output(p: pb.SamplingParams) -> StructuredOutput | None:
    """The protocol's `constraint` oneof (smg sends a json_object response format as json_schema
    {"type":"object"}; the proto's json_object is carried all the same)."""
    kind = p.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "choice":
        return StructuredOutput(choice=tuple(p.choice.choices))
    return StructuredOutput(**{kind: getattr(p, kind)})


def check_unsupported_inputs(request: pb.GenerateRequest) -> None:
    for name in ("mm_inputs", "media_refs", "kv_transfer_params"):
        if request.HasField(name):
            raise InvalidArgumentError(name, "is not supported by ninfer (text models; PD hand-offs come in "
                                       "kv_transfer_params_json, smg's NixlConnector mode)")
    if request.extra_mm_inputs:
        raise InvalidArgumentError("extra_mm_inputs", "is not supported by ninfer")
    if request.WhichOneof("input") is None:
        raise InvalidArgumentError("input", "a prompt is required (tokenized or text)")


# -- responses --------------------------------------------------------------------------------------

def chunk(token_ids: list[int], prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, index: int = 0,
          logprobs: list[TokenLogprob] | None = None, prompt_ids: list[int] | None = None,
          prompt_logprobs: list[TokenLogprob | None] | None = None) -> pb.GenerateResponse:
    msg = pb.GenerateStreamChunk(token_ids=token_ids, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                 cached_tokens=cached_tokens, index=index)
    if logprobs is not None:
        msg.output_logprobs.CopyFrom(output_logprobs(logprobs))
    if prompt_logprobs is not None:
        msg.input_logprobs.CopyFrom(input_logprobs(prompt_ids or [], prompt_logprobs))
    return pb.GenerateResponse(chunk=msg)


def complete(output_ids: list[int], stats: RequestStats, matched_token_id: int | None, index: int = 0,
             logprobs: list[TokenLogprob] | None = None, prompt_ids: list[int] | None = None,
             prompt_logprobs: list[TokenLogprob | None] | None = None) -> pb.GenerateResponse:
    """The final message of one sequence. Usage, cached tokens and MTP acceptance fit the protocol's
    fields; the timings do not (they go in the trailer, see vllm_servicer)."""
    u, spec = stats.usage, stats.speculative
    done = pb.GenerateComplete(
        output_ids=output_ids, finish_reason=stats.finish_reason.value if stats.finish_reason else "stop",
        prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens,
        spec_accepted_tokens=spec.accepted, spec_draft_tokens=spec.drafted, index=index)
    if matched_token_id is not None:
        done.matched_token_id = matched_token_id
    if logprobs is not None:
        done.output_logprobs.CopyFrom(output_logprobs(logprobs))
    if prompt_logprobs is not None:
        done.input_logprobs.CopyFrom(input_logprobs(prompt_ids or [], prompt_logprobs))
    return pb.GenerateResponse(complete=done)


def output_logprobs(logprobs: list[TokenLogprob]) -> pb.OutputLogProbs:
    """The shape smg renders: per position the token's logprob and id, and the alternatives in the
    engine's order (most likely first); smg neither sorts them nor adds the chosen token."""
    return pb.OutputLogProbs(
        token_logprobs=[lp.logprob for lp in logprobs], token_ids=[lp.token_id for lp in logprobs],
        top_logprobs=[pb.TopLogProbs(values=[v for _, v in lp.top], token_ids=[t for t, _ in lp.top])
                      for lp in logprobs])


def input_logprobs(prompt_ids: list[int], logprobs: list[TokenLogprob | None]) -> pb.InputLogProbs:
    """Per prompt token: its logprob (unset for the first, which nothing precedes) and the alternatives."""
    return pb.InputLogProbs(
        token_logprobs=[pb.InputTokenLogProb(value=lp.logprob) if lp is not None else pb.InputTokenLogProb()
                        for lp in logprobs],
        token_ids=prompt_ids,
        top_logprobs=[pb.TopLogProbs(values=[v for _, v in lp.top], token_ids=[t for t, _ in lp.top])
                      if lp is not None else pb.TopLogProbs() for lp in logprobs])


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
