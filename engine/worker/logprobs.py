"""Log-probabilities on the device (engine.sampling_params.TokenLogprob says which distribution), read with the round.

A round with any row that wants logprobs computes, at each of its positions, the raw log-softmax,
the logprob and rank of the token the round emitted there and the top MAX_LOGPROBS alternatives
(a fixed width, so the round stays one CUDA graph per variant); the host keeps each request's N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import TokenLogprob
from engine.sampling_params import MAX_LOGPROBS


@dataclass
class RoundLogprobs:
    """token [B, w] float32 (the emitted token's logprob), rank [B, w] int64, top_values [B, w, L]
    float32, top_ids [B, w, L] int64 (L = MAX_LOGPROBS, most likely first)."""

    token: torch.Tensor
    rank: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.token, self.rank, self.top_values, self.top_ids


def compute(logits: torch.Tensor, tokens: torch.Tensor) -> RoundLogprobs:
    """logits [B, w, V] (raw, the target's) and the tokens [B, w] at those positions (-1: none)."""
    lp = logits.float().log_softmax(-1)                                          # [B, w, V]
    token = lp.gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)        # [B, w]
    rank = (lp > token.unsqueeze(-1)).sum(-1) + 1
    top_values, top_ids = lp.topk(min(MAX_LOGPROBS, lp.shape[-1]), dim=-1)
    return RoundLogprobs(token, rank, top_values, top_ids)


def rows_to_host(lp: RoundLogprobs, rows: list[int], widths: list[int], wanted: list[int]) -> list[list[TokenLogprob]]:
    """The host's view of some rows: row rows[i]'s first widths[i] positions, top-`wanted[i]` each."""
    if not rows:
        return []
    index = torch.tensor(rows, dtype=torch.int64, device=lp.token.device)
    token, rank, values, ids = (t.index_select(0, index).cpu().tolist() for t in lp.tensors())
    tokens_out = []
    for i in range(len(rows)):
        n = wanted[i]
        tokens_out.append([(token[i][j], rank[i][j], values[i][j][:n], ids[i][j][:n]) for j in range(widths[i])])
    return tokens_out


def as_token_logprobs(token_ids: list[int], rows) -> list[TokenLogprob]:
    return [TokenLogprob(t, lp, rank, tuple(zip(top_ids, top_values)))
            for t, (lp, rank, top_values, top_ids) in zip(token_ids, rows)]


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], wanted: int) -> list[TokenLogprob]:
    """logits [n, V] of a prompt chunk's positions and the tokens that follow them (len <= n: the
    prompt's last position has none) -> each following token's TokenLogprob."""
    m = len(next_ids)
    if m == 0:
        return []
    ids = torch.tensor(next_ids, dtype=torch.int64, device=logits.device)
    out = compute(logits[:m].unsqueeze(0), ids.unsqueeze(0))
    (rows,) = rows_to_host(out, [0], [m], [wanted])
    return as_token_logprobs(next_ids, rows)
