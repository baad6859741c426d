"""Tokenizer (Hugging Face `tokenizers`) and incremental detokenization that never splits a character."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

REPLACEMENT_CHAR = "\ufffd"


CHAT_ROLES = ("system", "user", "assistant", "tool")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


class Tokenizer:
    """`encode` parses special-token strings into their ids (for trusted text: templates, tests);
    `encode_text` never does (for what a client wrote: "<|im_start|>" in it stays characters)."""

    def __init__(self, inner: HFTokenizer, eos_token_ids: tuple[int, ...] = ()):
        self.inner = inner
        self.eos_token_ids = eos_token_ids
        added = inner.get_added_tokens_decoder()
        self.special_ids = {i for i, tok in added.items() if tok.special}
        self.added_ids = set(added)
        # the same tokenizer with special-token parsing off (a separate instance: the flag is the
        # tokenizer's, and requests of both kinds run at once)
        self._text_only = HFTokenizer.from_str(inner.to_str())
        self._text_only.encode_special_tokens = True

    @classmethod
    def from_file(cls, path: str | Path, eos_token_ids: tuple[int, ...] = ()) -> "Tokenizer":
        return cls(HFTokenizer.from_file(str(path)), eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text, add_special_tokens=False).ids

    def encode_releasing_gil(self, text: str, parse_special: bool = True) -> list[int]:
        """`encode` (or `encode_text` when not `parse_special`), with Python's GIL released while it
        runs (the library's batch path does; `encode` holds it): other threads go on meanwhile."""
        inner = self.inner if parse_special else self._text_only
        return inner.encode_batch([text], add_special_tokens=False)[0].ids

    def max_token_bytes(self) -> int:
        """An upper bound of the UTF-8 bytes one token decodes to: a vocabulary entry's UTF-8 length
        (byte-level entries stand for one byte per character of at most 2 UTF-8 bytes; others are the
        text itself)."""
        return max((len(t.encode()) for t in self.inner.get_vocab(with_added_tokens=True)), default=1)

    def encode_text(self, text: str) -> list[int]:
        """Client text: special-token strings are encoded as the characters they are, never as control tokens."""
        return self._text_only.encode(text, add_special_tokens=False).ids

    def encode_chat(self, messages: list[tuple[str, str]], add_generation_prompt: bool = True,
                    releasing_gil: bool = False) -> list[int]:
        """`apply_chat_template` tokenized so that only the template makes control tokens: each
        message's role and content are client text (`encode_text`), the template's <|im_start|> and
        <|im_end|> go in as their ids. For text without special-token strings this equals
        `encode(apply_chat_template(messages))` (special tokens split the text the same way)."""
        start, end = self.inner.token_to_id(IM_START), self.inner.token_to_id(IM_END)
        if start is None or end is None:              # a tokenizer without them: the template is text too
            return self.encode_releasing_gil(self.apply_chat_template(messages, add_generation_prompt), False)
        pieces = [f"{role}\n{content}" for role, content in messages]
        pieces += ["\n", "assistant\n"]
        encoded = (self._text_only.encode_batch(pieces, add_special_tokens=False) if releasing_gil
                   else [self._text_only.encode(p, add_special_tokens=False) for p in pieces])
        newline, generation = encoded[-2].ids, encoded[-1].ids
        ids: list[int] = []
        for e in encoded[:-2]:
            ids += [start, *e.ids, end, *newline]
        if add_generation_prompt:
            ids += [start, *generation]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = False) -> str:
        """Text of `ids`. With special tokens kept, `spaces_between_special_tokens` puts one space
        between each added token and the text beside it (the meaning of the flag in vLLM and
        transformers' Python tokenizers; the Rust tokenizer alone joins them without spaces)."""
        if skip_special_tokens or not spaces_between_special_tokens or not self.added_ids.intersection(ids):
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)
        parts: list[str] = []
        run: list[int] = []
        for t in ids:
            if t in self.added_ids:
                if run:
                    text = self.inner.decode(run, skip_special_tokens=False)
                    if text:
                        parts.append(text)
                    run = []
                parts.append(self.inner.id_to_token(t))
            else:
                run.append(t)
        if run:
            parts.append(self.inner.decode(run, skip_special_tokens=False))
        return " ".join(parts)

    def to_json(self) -> str:
        """The tokenizer.json text: engines hand it to gateways, which tokenize with it."""
        return self.inner.to_str()

    def apply_chat_template(self, messages: list[tuple[str, str]], add_generation_prompt: bool = True) -> str:
        """ChatML, the Qwen family's format: <|im_start|>role\\ncontent<|im_end|>\\n ..."""
        text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Byte-level tokens can end inside a multi-byte character; text that ends in U+FFFD is held back
    until the following tokens complete it. Only a short window of tokens is re-decoded per step.
    """

    def __init__(self, tokenizer: Tokenizer, context_ids: list[int] | None = None, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self._options = (skip_special_tokens, spaces_between_special_tokens)
        self.ids: list[int] = list(context_ids or [])[-6:]   # decoding context for leading spaces
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def push(self, new_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        self.ids.extend(new_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], *self._options)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], *self._options)
        if full.endswith(REPLACEMENT_CHAR) or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a stream: whatever is held back, replacement characters included."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], *self._options)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], *self._options)
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


def find_stop(text: str, stops: list[str], new_from: int) -> int | None:
    """Index where the earliest stop string starts, looking only at matches that end in text[new_from:]."""
    match = find_stop_match(text, stops, new_from)
    return None if match is None else match[0]


def find_stop_match(text: str, stops: list[str], new_from: int) -> tuple[int, str] | None:
    """(start, stop string) of the earliest stop string among the matches that end in text[new_from:]."""
    best: tuple[int, str] | None = None
    for stop in stops:
        i = text.find(stop, max(0, new_from - len(stop) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def stop_cut(text: str, stops: list[str], new_from: int, include_stop: bool) -> int | None:
    """Where the text ends at the earliest stop string: before it, or after it with `include_stop`
    (vLLM's include_stop_str_in_output); None when no stop string ends in text[new_from:]."""
    match = find_stop_match(text, stops, new_from)
    if match is None:
        return None
    return match[0] + len(match[1]) if include_stop else match[0]
