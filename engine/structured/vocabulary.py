"""The model's vocabulary as xgrammar matches it, built from the tokenizer.json text (no hub, no
transformers tokenizer object).

Two things the grammar engine must be told that a plain token list does not say:

* the logits are wider than the tokenizer (Qwen3: 151,936 logits for 151,669 tokens): the ids past
  the tokenizer are never allowed (`vocab_size` is the logits width);
* special added tokens (`<|im_start|>`, `<|endoftext|>` ...) are not text: left as their spelling,
  xgrammar would let `<|im_end|>` appear inside a JSON string. They are blanked (xgrammar treats an
  empty token as special: never allowed as text); the stop tokens are allowed exactly where the
  grammar may end. Non-special added tokens (Qwen3's `<tool_call>`, `<think>`) stay text, which is
  what structural tags match.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr


def _decoder_kinds(node: Any) -> list[str]:
    if not isinstance(node, dict):
        return []
    out = [node.get("type", "")]
    for child in node.get("decoders", []) + node.get("pretokenizers", []):
        out += _decoder_kinds(child)
    return out


def vocab_type(tokenizer_json: dict) -> tuple[xgr.VocabType, bool]:
    """(how tokens spell bytes, add_prefix_space) from a tokenizer.json's decoder and pre-tokenizer."""
    decoders = _decoder_kinds(tokenizer_json.get("decoder"))
    if "ByteLevel" in decoders:
        return xgr.VocabType.BYTE_LEVEL, False
    if "ByteFallback" in decoders:
        pre = _decoder_kinds(tokenizer_json.get("pre_tokenizer")) + _decoder_kinds(tokenizer_json.get("normalizer"))
        return xgr.VocabType.BYTE_FALLBACK, "Metaspace" in pre or "Prepend" in pre
    return xgr.VocabType.RAW, False


@dataclass(frozen=True)
class GrammarVocabulary:
    info: xgr.TokenizerInfo
    vocab_size: int                  # the logits width: bitmask rows cover it
    tokenizer_size: int
    stop_token_ids: tuple[int, ...]  # a grammar's default terminators (a request may name its own)

    @property
    def words(self) -> int:
        """int32 words of one bitmask row: ceil(vocab_size / 32)."""
        return (self.vocab_size + 31) // 32

    @classmethod
    def from_tokenizer_json(cls, text: str, vocab_size: int, stop_token_ids) -> "GrammarVocabulary":
        tj = json.loads(text)
        vocab: dict[str, int] = dict(tj["model"]["vocab"])
        special: list[int] = []
        for tok in tj.get("added_tokens", []):
            vocab[tok["content"]] = tok["id"]
            if tok.get("special"):
                special.append(tok["id"])
        tokenizer_size = max(vocab.values()) + 1
        if tokenizer_size > vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer_size} tokens, more than the {vocab_size} logits")
        encoded = [""] * tokenizer_size
        for spelling, idx in vocab.items():
            encoded[idx] = spelling
        for idx in special:
            encoded[idx] = ""
        stops = tuple(sorted({int(t) for t in stop_token_ids if 0 <= int(t) < vocab_size}))
        if not stops:
            raise ValueError("a grammar needs a stop token; the model names none")
        kind, prefix = vocab_type(tj)
        info = xgr.TokenizerInfo(encoded, kind, vocab_size=vocab_size, stop_token_ids=list(stops),
                                 add_prefix_space=prefix)
        return cls(info, vocab_size, tokenizer_size, stops)
