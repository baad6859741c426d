"""A GenerateRequest, validated and tokenized: what the engine calls need. Nothing is enqueued
before this passes; its errors name the field and the limit (INVALID_ARGUMENT).

Client text is never parsed for special tokens: a role must be one of system, user, assistant,
tool; the chat template's <|im_start|> / <|im_end|> are inserted as ids and the messages' text is
encoded with special-token parsing off, so "<|im_end|>" in a message stays those characters and no
one can forge a turn. A raw `prompt` is text too unless the request sets `parse_special_tokens`.

Sizes are checked before any tokenizing, with limits derived from the context (`max_model_len`):
a prompt of more than MAX_CHARS_PER_TOKEN characters per token of context cannot fit, nor can more
messages than half the context (a chat message takes at least two tokens: <|im_start|>, <|im_end|>),
nor a text whose UTF-8 bytes need more tokens than the context even if every token were the
vocabulary's longest (check_byte_bound: emoji are 4 bytes per character).
Tokenizing runs with the GIL released (other streams go on); a long text (more than SLOT_CHARS)
takes one of TOKENIZER_SLOTS first, waiting within its deadline, so that a burst of long prompts
neither takes every core nor delays short prompts (those never wait for a slot).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from engine.errors import InvalidArgumentError
from engine.sampling_params import SamplingParams
from engine.tokenizer import CHAT_ROLES
from ninfer.v1 import gateway_pb2
from services.convert import sampling_from_proto, token_ids_from_proto
from services.server.errors import RpcAbort
from gateway.router import ServedModel

MAX_CHARS_PER_TOKEN = 32          # far above any tokenizer's average (English text: about 4)
TOKENIZER_SLOTS = 2               # long tokenizations at once (each holds a core)
SLOT_CHARS = 8192                 # shorter texts tokenize at once (well under 10 ms)
_slots = threading.BoundedSemaphore(TOKENIZER_SLOTS)


@dataclass
class PreparedRequest:
    prompt_ids: list[int]
    params: SamplingParams            # validated; the engine gets the request's own proto
    operation: str                    # gen_ai.operation.name: "chat" or "text_completion"


def prepare(request: gateway_pb2.GenerateRequest, model: ServedModel, wait_s: float | None = None) -> PreparedRequest:
    """`wait_s`: how long the request may wait for a tokenizer slot (its deadline; None = no limit)."""
    info, tokenizer = model.info, model.tokenizer
    if request.model and request.model != info.model:
        raise InvalidArgumentError("model", f"unknown model {request.model!r}; this gateway serves {info.model!r}")
    params = sampling_from_proto(request.sampling)
    max_chars = info.max_model_len * MAX_CHARS_PER_TOKEN
    kind = request.WhichOneof("input")
    if kind == "prompt" and request.prompt:
        if len(request.prompt) > max_chars:
            raise InvalidArgumentError("prompt", f"{len(request.prompt)} characters exceed the limit of {max_chars} "
                                       f"({MAX_CHARS_PER_TOKEN} per token of max_model_len={info.max_model_len})")
        check_byte_bound("prompt", len(request.prompt.encode()), model)
        ids, operation = _encode(tokenizer, request.prompt, wait_s, request.parse_special_tokens), "text_completion"
    elif kind == "messages" and request.messages.messages:
        messages = request.messages.messages
        if len(messages) > info.max_model_len // 2:
            raise InvalidArgumentError("messages", f"{len(messages)} messages exceed the limit of "
                                       f"{info.max_model_len // 2} (half of max_model_len={info.max_model_len})")
        chars = sum(len(m.role) + len(m.content) for m in messages)
        if chars > max_chars:
            raise InvalidArgumentError("messages", f"{chars} characters exceed the limit of {max_chars} "
                                       f"({MAX_CHARS_PER_TOKEN} per token of max_model_len={info.max_model_len})")
        check_roles(messages)
        check_byte_bound("messages", sum(len(m.content.encode()) for m in messages), model)
        if request.parse_special_tokens:
            raise InvalidArgumentError("parse_special_tokens", "applies to `prompt` only: chat messages are "
                                       "always text (the template alone makes control tokens)")
        ids, operation = _encode_chat(tokenizer, [(m.role, m.content) for m in messages], wait_s), "chat"
    elif kind == "prompt_token_ids" and request.prompt_token_ids.ids:
        ids = request.prompt_token_ids.ids
        if len(ids) >= info.max_model_len:
            raise InvalidArgumentError("prompt_token_ids", f"{len(ids)} prompt tokens leave no room under the "
                                       f"context limit of {info.max_model_len} tokens")
        ids = token_ids_from_proto(ids, "prompt_token_ids", info.vocab_size)
        operation = "text_completion"
    else:
        raise InvalidArgumentError(kind or "prompt", "must not be empty (give prompt, messages or prompt_token_ids)")
    if len(ids) >= info.max_model_len:
        raise InvalidArgumentError(kind, f"{len(ids)} prompt tokens leave no room under the context limit of "
                                         f"{info.max_model_len} tokens")
    if not request.sampling.HasField("max_tokens"):        # the default, clamped to what the context leaves
        params = sampling_from_proto(request.sampling, room=info.max_model_len - len(ids))
    return PreparedRequest(ids, params, operation)


async def prepare_off_loop(request: gateway_pb2.GenerateRequest, model: ServedModel,
                           wait_s: float | None = None) -> PreparedRequest:
    """`prepare` for the server's event loop: short inputs at once (well under a millisecond), long
    ones on a worker thread, so that tokenizing them never stalls the other streams."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        chars = len(request.prompt)
    elif kind == "messages":
        messages = request.messages.messages
        chars = SLOT_CHARS + 1 if len(messages) > SLOT_CHARS else sum(len(m.content) for m in messages)
    else:
        chars = 0
    if chars <= SLOT_CHARS:
        return prepare(request, model, wait_s)
    return await asyncio.to_thread(prepare, request, model, wait_s)


def check_byte_bound(field: str, num_bytes: int, model: ServedModel) -> None:
    """A text of B UTF-8 bytes takes at least B / (the longest token's bytes) tokens: past the context,
    it is refused before the tokenizer builds an encoding of it (131,072 emoji passed the character
    bound, became 524,288 tokens and lifted the gateway to 720 MiB before the token count refused them)."""
    longest = model.max_token_bytes
    least = -(-num_bytes // longest)
    if least >= model.info.max_model_len:
        raise InvalidArgumentError(field, f"{num_bytes} UTF-8 bytes make at least {least} tokens (a token covers at "
                                   f"most {longest} bytes), beyond the context limit of {model.info.max_model_len}")


def check_roles(messages) -> None:
    """Each role is one of CHAT_ROLES, exactly (no case folding, no padding): anything else would be
    rendered into the template as is."""
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidArgumentError(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, "
                                       f"got {m.role[:40]!r}")


def _encode(tokenizer, text: str, wait_s: float | None, parse_special: bool) -> list[int]:
    """Client text as token ids: special-token strings stay text unless `parse_special`."""
    with _slot(len(text), wait_s):
        return tokenizer.encode_releasing_gil(text, parse_special)


def _encode_chat(tokenizer, messages: list[tuple[str, str]], wait_s: float | None) -> list[int]:
    with _slot(sum(len(r) + len(c) for r, c in messages), wait_s):
        return tokenizer.encode_chat(messages, releasing_gil=True)


@contextmanager
def _slot(chars: int, wait_s: float | None) -> Iterator[None]:
    """A tokenizer slot for a long text (short ones tokenize at once)."""
    if chars <= SLOT_CHARS:
        yield
        return
    if not _slots.acquire(timeout=wait_s):
        raise RpcAbort(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed while waiting to tokenize")
    try:
        yield
    finally:
        _slots.release()
