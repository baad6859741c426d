"""Vocabulary-parallel token embedding and lm_head: each rank holds a contiguous slice of rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel import SINGLE_RANK, TPGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = SINGLE_RANK):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // tp.size)             # rows per rank (last rank padded)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = max(0, min(self.rows, self.vocab_size - self.start))
        param.data[:n].copy_(loaded[self.start:self.start + n])
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight) * inside.unsqueeze(-1)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocabulary slice, gathered over ranks."""

    def forward(self, hidden: torch.Tensor, num_rows: int | None = None) -> torch.Tensor:
        # hidden: [N, hidden] -> logits [N, vocab]; num_rows limits the projection to the first
        # `num_rows` token ids (a reduced draft vocabulary), only on one rank.
        if num_rows is not None and self.tp.size == 1:
            return F.linear(hidden, self.weight[:num_rows])
        logits = self.tp.all_gather(F.linear(hidden, self.weight))
        return logits[..., :self.vocab_size if num_rows is None else num_rows]
