"""Tensor-parallel groups and their communicators.

A model shard is built for one rank of a `TPGroup`; its row-parallel layers call
`group.all_reduce` once per block (after attention and after the MLP), and so do its
vocabulary-parallel embedding and lm_head (each rank's rows, zeros elsewhere; see
`engine.layers.embedding`). With one rank every call is a no-op.

`LocalCommunicator` runs all ranks inside one process, each rank in its own thread (CPU tests and
the reference for the GPU communicators): a collective is a barrier, a sum of the ranks' buffers,
and a second barrier.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import torch


class Communicator(Protocol):
    world_size: int

    def all_reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks; every rank gets the sum (in place where it can)."""

    def all_gather(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the ranks' `x` along the last dimension, in rank order."""


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    comm: Communicator | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.size == 1 else self.comm.all_reduce(self.rank, x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.size == 1 else self.comm.all_gather(self.rank, x)

    def shard(self, n: int, what: str) -> int:
        """The per-rank share of `n` units (heads, rows) that must split evenly."""
        if n % self.size:
            raise ValueError(f"{what}={n} does not split over tensor_parallel_size={self.size}")
        return n // self.size


SINGLE_RANK = TPGroup()


class LocalCommunicator:
    """All ranks in one process, one thread each. Deterministic: sums in rank order."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size, timeout=600)   # a dead rank must not hang the rest
        self._slots: list[torch.Tensor | None] = [None] * world_size

    def _exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self._slots[rank] = x
        self._barrier.wait()
        parts = [t.to(x.device) for t in self._slots]
        self._barrier.wait()  # nobody overwrites a slot before everyone has read it
        return parts

    def all_reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(rank, x.clone())
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        x.copy_(total)
        return x

    def all_gather(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(rank, x), dim=-1)

    def groups(self) -> list[TPGroup]:
        return [TPGroup(rank=r, size=self.world_size, comm=self) for r in range(self.world_size)]
