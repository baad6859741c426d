"""Independent references for the sampling tests: vLLM's logit options written out token by token
from their definitions (docs/sampling.md), the float32 transformers model, and its log-softmax.

Nothing here imports the engine's sampler: a test that compares the two checks the engine's
batched, speculative, on-device implementation against the plain formula."""

from __future__ import annotations

import math

import torch


def reference_adjust(logits: torch.Tensor, prompt: list[int], output: list[int], *, presence: float = 0.0,
                     frequency: float = 0.0, repetition: float = 1.0, min_tokens: int = 0,
                     stop_ids: set[int] = frozenset(), logit_bias: dict[int, float] | None = None,
                     bad_words: list[list[int]] = ()) -> torch.Tensor:
    """logits [V] (one position) -> the logits vLLM samples from, given the request's history."""
    x = logits.float().clone()
    vocab = x.shape[0]
    for word in bad_words:                          # a word bans its last token after its prefix
        prefix, last = list(word[:-1]), word[-1]
        if len(prefix) <= len(output) and (not prefix or output[-len(prefix):] == prefix):
            x[last] = -math.inf
    if len(output) < min_tokens:
        for t in stop_ids:
            x[t] = -math.inf
    for t, b in (logit_bias or {}).items():
        x[t] += b
    counts = torch.zeros(vocab)
    for t in output:
        counts[t] += 1
    in_prompt = torch.zeros(vocab, dtype=torch.bool)
    in_prompt[prompt] = True
    for t in range(vocab):
        if in_prompt[t] or counts[t] > 0:
            x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    return x - frequency * counts - presence * (counts > 0).float()


def load_reference_model(path: str):
    """transformers' Qwen3ForCausalLM of `path` in float32 (the MTP weights are not part of it)."""
    transformers = __import__("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float32 logits at every position."""
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def reference_greedy(model, prompt: list[int], n: int, **options) -> list[int]:
    """n greedy tokens, each the argmax of `reference_adjust` of the full sequence's last logits."""
    out: list[int] = []
    for _ in range(n):
        logits = reference_logits(model, prompt + out)[-1]
        out.append(int(reference_adjust(logits, prompt, out, **options).argmax()))
    return out
