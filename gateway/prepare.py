"""A GenerateRequest, validated and tokenized: what the engine calls need. Nothing is enqueued
before this passes; its errors name the field (INVALID_ARGUMENT)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidArgumentError
from engine.sampling_params import SamplingParams
from ninfer.v1 import gateway_pb2
from services.convert import sampling_from_proto, token_ids_from_proto
from gateway.router import ServedModel


@dataclass
class PreparedRequest:
    prompt_ids: list[int]
    params: SamplingParams            # validated; the engine gets the request's own proto
    operation: str                    # gen_ai.operation.name: "chat" or "text_completion"


def prepare(request: gateway_pb2.GenerateRequest, model: ServedModel) -> PreparedRequest:
    info, tokenizer = model.info, model.tokenizer
    if request.model and request.model != info.model:
        raise InvalidArgumentError("model", f"unknown model {request.model!r}; this gateway serves {info.model!r}")
    params = sampling_from_proto(request.sampling)
    kind = request.WhichOneof("input")
    if kind == "prompt" and request.prompt:
        ids, operation = tokenizer.encode(request.prompt), "text_completion"
    elif kind == "messages" and request.messages.messages:
        for i, m in enumerate(request.messages.messages):
            if not m.role:
                raise InvalidArgumentError(f"messages[{i}].role", "must not be empty")
        text = tokenizer.apply_chat_template([(m.role, m.content) for m in request.messages.messages])
        ids, operation = tokenizer.encode(text), "chat"
    elif kind == "prompt_token_ids" and request.prompt_token_ids.ids:
        ids = token_ids_from_proto(request.prompt_token_ids.ids, "prompt_token_ids", info.vocab_size)
        operation = "text_completion"
    else:
        raise InvalidArgumentError(kind or "prompt", "must not be empty (give prompt, messages or prompt_token_ids)")
    if len(ids) >= info.max_model_len:
        raise InvalidArgumentError(kind, f"{len(ids)} prompt tokens leave no room under the context limit of "
                                         f"{info.max_model_len} tokens")
    return PreparedRequest(ids, params, operation)
