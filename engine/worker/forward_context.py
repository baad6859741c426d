"""The one typed carrier of paged-attention metadata from the runner to the attention layers.

The model's signature stays `(input_ids, positions) -> hidden`; attention layers read the context
of the forward in flight. A prefill chunk, a decode step and a verify pass are the same thing here:
B sequences each add `query_len` new tokens after `seq_len - query_len` tokens already in the KV.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from engine.worker.paged_kv import GatherPlan, SegmentPlan, gather_plan, segment_plan


@dataclass
class ForwardContext:
    # [T] int64: the KV slot (block_id * block_size + offset) each new token writes; -1 = none.
    slot_mapping: torch.Tensor
    # [B + 1] int32: where each sequence's new tokens start in the flat batch of T tokens.
    query_start_loc: torch.Tensor
    # [B] int32: tokens of each sequence in the KV once this forward has written its new ones.
    seq_lens: torch.Tensor
    # [B, max_blocks] int32: each sequence's KV pages in position order (unused entries: any block).
    block_tables: torch.Tensor
    # Host bounds that pick and size kernels without reading the device: the longest run of new
    # tokens, and an upper bound of seq_lens (exact when eager; the context limit in CUDA graphs).
    max_query_len: int
    max_seq_len: int
    # Set when every sequence adds the same number of tokens (decode and verify rounds).
    uniform_query_len: int | None = None
    # Hybrid models: [B] int64, each sequence's linear-attention state slot (engine.worker.state_pool).
    state_slots: torch.Tensor | None = None
    # A verify pass: linear layers keep their inputs and leave the states to `commit_linear_states`.
    defer_state_commit: bool = False
    # Each sequence's new tokens, on the host (eager prefill): a varlen layer splits by it without a read.
    host_query_lens: tuple[int, ...] | None = None
    # Each sequence's keys once this forward has written its new ones, on the host (eager prefill):
    # prefill attention gathers the pages into contiguous K/V by it (engine/kernels/attention/prefill_tma.py).
    # Both host fields stay None in any context a CUDA graph captures: they are baked in, not replayed.
    host_seq_lens: tuple[int, ...] | None = None
    # The pages' gather into contiguous K/V, made by the first layer that asks (`gather_plan`).
    _gather_plans: dict[int, GatherPlan] = field(default_factory=dict, init=False, repr=False, compare=False)
    _segment_plans: dict[tuple[int, int], SegmentPlan] = field(default_factory=dict, init=False, repr=False,
                                                               compare=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def gather_plan(self, page: int) -> GatherPlan:
        """Where this forward's keys sit in pages of `page` keys (host_seq_lens set): built once, for every
        layer of the forward."""
        if page not in self._gather_plans:
            self._gather_plans[page] = gather_plan(self.block_tables, list(self.host_seq_lens), page)
        return self._gather_plans[page]

    def segment_plan(self, page: int, segment_keys: int) -> SegmentPlan:
        """The one sequence's keys in segments (host lengths set, one sequence): built once per forward."""
        key = (page, segment_keys)
        if key not in self._segment_plans:
            self._segment_plans[key] = segment_plan(self.block_tables, self.host_seq_lens[0],
                                                    self.host_query_lens[0], page, segment_keys)
        return self._segment_plans[key]

    def host_lens(self) -> tuple[list[int], list[int]]:
        """(query lengths, sequence lengths) on the host; a device read, for the CPU path only."""
        starts = self.query_start_loc.tolist()
        return [b - a for a, b in zip(starts, starts[1:])], self.seq_lens.tolist()


# Per thread: with tensor parallelism in one process, each rank's thread runs its own forward.
_local = threading.local()


def get_forward_context() -> ForwardContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("attention ran outside a forward context")
    return ctx


@contextmanager
def forward_context(ctx: ForwardContext):
    previous, _local.ctx = getattr(_local, "ctx", None), ctx
    try:
        yield ctx
    finally:
        _local.ctx = previous


def build_forward_context(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                          block_size: int, device: torch.device,
                          state_slots: list[int] | None = None) -> tuple[torch.Tensor, ForwardContext]:
    """Positions [T] and context for sequences whose new tokens sit at [seq_len - query_len, seq_len)."""
    q = torch.tensor(query_lens, dtype=torch.int64)
    s = torch.tensor(seq_lens, dtype=torch.int64)
    width = max(max((len(t) for t in block_tables), default=0), 1)
    tables = torch.zeros(len(block_tables), width, dtype=torch.int64)
    for i, t in enumerate(block_tables):
        tables[i, :len(t)] = torch.tensor(t, dtype=torch.int64)
    seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), q)       # [T]
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
    starts[1:] = torch.cumsum(q, 0)
    offset_in_seq = torch.arange(int(starts[-1])) - starts[seq_of_token]
    positions = (s - q)[seq_of_token] + offset_in_seq                              # [T]
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    uniform = query_lens[0] if query_lens and all(n == query_lens[0] for n in query_lens) else None
    ctx = ForwardContext(
        slot_mapping=slots.to(device, non_blocking=True),
        query_start_loc=starts.to(torch.int32).to(device, non_blocking=True),
        seq_lens=s.to(torch.int32).to(device, non_blocking=True),
        block_tables=tables.to(torch.int32).to(device, non_blocking=True),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        uniform_query_len=uniform,
        state_slots=(None if state_slots is None
                     else torch.tensor(state_slots, dtype=torch.int64).to(device, non_blocking=True)),
        host_query_lens=tuple(query_lens),
        host_seq_lens=tuple(seq_lens),
    )
    return positions.to(device, non_blocking=True), ctx
