"""Grammar fixtures shared by the structured-output tests: the shared model's vocabulary, schemas
and grammars with an independent validator each, and a sampler that walks a matcher."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.structured.bitmask import apply_token_mask
from engine.structured.compiler import GrammarCompiler
from engine.structured.matcher import GrammarState
from engine.structured.vocabulary import GrammarVocabulary

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,8}@[a-z]{2,6}\.(com|org|net)( [A-Z][a-z]{0,5}){0,3}"
CHOICES = ["positive", "negative", "neutral", 'say "hi"', "café ☕"]
EBNF = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]{1,4}
"""
TOOL_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
               "required": ["city", "days"], "additionalProperties": False}
STRUCTURAL_TAG = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<tool_call>"],
    "tags": [{"begin": "<tool_call>\n", "content": {"type": "json_schema", "json_schema": TOOL_SCHEMA},
              "end": "\n</tool_call>"}]}}


def vocabulary(model_dir: str, vocab_size: int | None = None) -> GrammarVocabulary:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = (Path(model_dir) / "tokenizer.json").read_text()
    return GrammarVocabulary.from_tokenizer_json(text, vocab_size or config["vocab_size"], [config["eos_token_id"]])


def compile_sync(compiler: GrammarCompiler, spec):
    return compiler.compile(spec).result(timeout=60)


def end_bias(vocab: GrammarVocabulary) -> torch.Tensor:
    """+3 for tokens made only of closing characters, +5 for the stop tokens: unbounded grammars end."""
    bias = torch.zeros(vocab.vocab_size)
    for i, b in enumerate(vocab.info.decoded_vocab):
        if b and all(c in b'"}]) ' for c in b) and any(c in b'"}])' for c in b):
            bias[i] = 3.0
    bias[list(vocab.stop_token_ids)] = 5.0
    return bias


def walk(state: GrammarState, vocab: GrammarVocabulary, seed: int, bias: torch.Tensor | None = None,
         max_tokens: int = 400, prefix: list[int] = ()) -> tuple[list[int], bool]:
    """Sample from random logits under the mask until a stop token -> (tokens without it, stopped)."""
    gen = torch.Generator().manual_seed(seed)
    row = torch.empty(1, vocab.words, dtype=torch.int32)
    out = list(prefix)
    assert state.accept_tokens(prefix) == len(prefix)
    for _ in range(max_tokens):
        state.fill(row[0])
        logits = torch.randn(1, vocab.vocab_size, generator=gen)
        if bias is not None:
            logits += bias
        t = int(apply_token_mask(logits, row).argmax())
        assert state.accept(t), f"sampled token {t} refused"
        if state.terminated:
            assert t in vocab.stop_token_ids
            return out, True
        out.append(t)
    return out, False
