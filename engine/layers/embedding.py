"""Vocabulary-parallel token embedding and lm_head: each rank holds a contiguous slice of rows.

With several ranks both layers end in one all-reduce: the embedding sums the rows each rank
found (the others contribute zeros), and the lm_head sums a logits buffer into which each rank
wrote its own columns. A zero-padded all-reduce is an all-gather that needs no other collective
(the one-shot peer-to-peer kernel and a CUDA graph both take it), and adding zeros is exact, so
every rank holds bitwise the same logits and samples the same tokens. The price: each rank reads
(tp - 1) whole-vocabulary buffers where an all-gather reads (tp - 1) / tp of one -- twice the bytes
at TP2 (12 us for the 1.2 MB of four rows of qwen3 logits on the H200 pair), tp times beyond; a
gather kernel would be the next step there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.tp_group import SINGLE_RANK, TPGroup


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
        n = self.rows_below(self.vocab_size)
        param.data[:n].copy_(loaded[self.start:self.start + n])
        param.data[n:].zero_()

    def rows_below(self, limit: int) -> int:
        """How many of this rank's rows hold token ids < limit."""
        return max(0, min(self.rows, limit - self.start))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight) * inside.unsqueeze(-1)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the whole vocabulary (or its first `num_rows` ids) on every rank."""

    def forward(self, hidden: torch.Tensor, num_rows: int | None = None) -> torch.Tensor:
        # hidden: [N, hidden] -> logits [N, limit], limit = num_rows or the vocabulary. A reduced
        # draft vocabulary is projected only by the ranks that own some of its rows.
        limit = self.vocab_size if num_rows is None else min(num_rows, self.vocab_size)
        mine = self.rows_below(limit)
        if self.tp.size == 1:
            return self._project(hidden, self.weight if mine == self.rows else self.weight[:mine])
        logits = hidden.new_zeros(hidden.shape[0], limit)
        if mine:
            logits[:, self.start:self.start + mine] = self._project(hidden, self.weight[:mine])
        return self.tp.all_reduce(logits)

    @staticmethod
    def _project(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden]; weight: [V, hidden] -> [N, V]; decode rows take the GEMV where it beat cuBLAS
        if hidden.is_cuda:
            from engine.kernels.linear import gemv
            return gemv.dense(hidden, weight)
        return F.linear(hidden, weight)
