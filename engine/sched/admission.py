"""The checks of a request's sampling options that need the served model: token ids against the
vocabulary, bad words through the tokenizer, n against the decode batch, prompt truncation against
the context. Run by `EngineCore.add_request` before anything is enqueued; every refusal is an
InvalidArgumentError naming the field and the limit. No torch.

Structured output is checked where its grammar compiles (engine.structured: GrammarError names
`structured_output.<kind>`), before the request reaches the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidArgumentError
from engine.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams


@dataclass(frozen=True)
class AdmittedOptions:
    truncate_to: int | None                          # keep this many trailing prompt tokens (None: all)
    bad_words_token_ids: tuple[tuple[int, ...], ...]  # each: banned last token after its prefix


def admit_options(params: SamplingParams, vocab_size: int, tokenizer, max_batch: int,
                  max_model_len: int) -> AdmittedOptions:
    if params.n > max_batch:
        raise InvalidArgumentError("n", f"{params.n} sequences exceed the decode batch of {max_batch} "
                                        f"(--max-num-seqs): the n sequences of a request decode together")
    if params.logit_bias:
        bad = next((t for t in params.logit_bias if t >= vocab_size), None)
        if bad is not None:
            raise InvalidArgumentError("logit_bias", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    words = bad_words_token_ids(params.bad_words, tokenizer, vocab_size) if params.bad_words else ()
    return AdmittedOptions(truncation(params, max_model_len), words)


def truncation(params: SamplingParams, max_model_len: int) -> int | None:
    """How many trailing prompt tokens `truncate_prompt_tokens` keeps (-1: the context limit); None: all."""
    return max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens


def bad_words_token_ids(words: list[str], tokenizer, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """vLLM's reading of `bad_words`: each word tokenized as it stands (leading spaces dropped) and
    with one leading space (a word in the middle of text), the second kept only when it is a
    different first token of the same length. A word of m tokens bans its last token wherever the
    last m - 1 generated tokens are its first m - 1."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip()))
        spaced = tuple(tokenizer.encode(" " + word.lstrip()))
        for ids in (plain, spaced):
            if ids is spaced and not (spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain)):
                continue
            if not ids:
                continue
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise InvalidArgumentError("bad_words", f"{word!r:.80} is {len(ids)} tokens; at most "
                                                        f"{MAX_BAD_WORD_TOKENS} per word")
            if any(not 0 <= t < vocab_size for t in ids):
                raise InvalidArgumentError("bad_words", f"{word!r:.80} tokenizes outside the vocabulary")
            out.append(ids)
    return tuple(out)
