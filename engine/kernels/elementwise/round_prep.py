"""The decode round's bookkeeping on the device in one launch each, where torch takes ~16 and ~10.

`uniform_context` (positions, slot mapping, sequence lengths and query offsets of B sequences adding
query_len tokens each) and `carry_forward` (a round's carried rows completed from the last round's tokens)
are small integer functions of a round's packed inputs. Written as torch ops they are a chain of tiny
kernels at the head of every captured round -- and of every MTP draft step, which computes its own
context -- each costing a launch in the graph. Here each is one program over the whole batch. The torch
code in `engine.worker.decode_round` is the reference (and the CPU path); tests/engine/kernels/elementwise/test_round_prep.py holds the two
equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _uniform_context_kernel(start_ptr, tables_ptr, positions_ptr, slots_ptr, seq_lens_ptr, qsl_ptr, B, stride_tab,
                            QUERY_LEN: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr):
    i = tl.arange(0, BLOCK)                                    # flat token index: row i // QUERY_LEN
    ok = i < B * QUERY_LEN
    row = i // QUERY_LEN
    pos = tl.load(start_ptr + row, mask=ok, other=0) + i % QUERY_LEN
    blk = tl.load(tables_ptr + row.to(tl.int64) * stride_tab + pos // PAGE, mask=ok, other=0).to(tl.int64)
    tl.store(positions_ptr + i, pos, mask=ok)
    tl.store(slots_ptr + i, blk * PAGE + pos % PAGE, mask=ok)
    b = tl.arange(0, BLOCK_B)
    start = tl.load(start_ptr + b, mask=b < B, other=0)
    tl.store(seq_lens_ptr + b, (start + QUERY_LEN).to(tl.int32), mask=b < B)
    tl.store(qsl_ptr + b, (b * QUERY_LEN).to(tl.int32), mask=b <= B)


def uniform_context(start: torch.Tensor, query_len: int, block_tables: torch.Tensor, block_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """start: [B] int64 (non-negative); block_tables: [B, W] int32 -> (positions [B*q] int64, slot_mapping
    [B*q] int64, seq_lens [B] int32, query_start_loc [B+1] int32), as engine.worker.decode_round.uniform_context."""
    bsz = start.shape[0]
    n = bsz * query_len
    dev = start.device
    positions = torch.empty(n, dtype=torch.int64, device=dev)
    slots = torch.empty(n, dtype=torch.int64, device=dev)
    seq_lens = torch.empty(bsz, dtype=torch.int32, device=dev)
    qsl = torch.empty(bsz + 1, dtype=torch.int32, device=dev)
    _uniform_context_kernel[(1,)](start, block_tables, positions, slots, seq_lens, qsl, bsz, block_tables.stride(0),
                                  QUERY_LEN=query_len, PAGE=block_size, BLOCK=triton.next_power_of_2(max(n, 2)),
                                  BLOCK_B=triton.next_power_of_2(bsz + 1), num_warps=4)
    return positions, slots, seq_lens, qsl


@triton.jit
def _carry_forward_kernel(carry_ptr, last_ptr, ids_ptr, ntok_ptr, counts_ptr, mtp_ptr, oidx_ptr,
                          ids_out, ntok_out, counts_out, mtp_out, oidx_out, B, stride_last, stride_mtp,
                          WIDTH: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr):
    b = tl.arange(0, BLOCK_B)
    w = tl.arange(0, BLOCK_W)
    ok = b < B
    cell = ok[:, None] & (w[None, :] < WIDTH)
    row = tl.load(carry_ptr + b, mask=ok, other=-1)
    carried = row >= 0
    prev = tl.load(last_ptr + tl.maximum(row, 0)[:, None] * stride_last + w[None, :], mask=cell, other=-1)
    emitted = tl.sum((prev >= 0).to(tl.int64), 1)                             # accepted + 1
    added = tl.where(carried, emitted, 0)
    pick = w[None, :] == tl.maximum(emitted - 1, 0)[:, None]
    bonus = tl.sum(tl.where(pick & cell, prev, 0), 1)
    tl.store(ids_out + b, tl.where(carried, bonus, tl.load(ids_ptr + b, mask=ok)), mask=ok)
    tl.store(ntok_out + b, tl.load(ntok_ptr + b, mask=ok) + added, mask=ok)
    tl.store(counts_out + b, tl.where(carried, emitted, tl.load(counts_ptr + b, mask=ok)), mask=ok)
    tl.store(oidx_out + b, tl.load(oidx_ptr + b, mask=ok) + added, mask=ok)
    mtp = tl.load(mtp_ptr + b[:, None] * stride_mtp + w[None, :], mask=cell)
    tl.store(mtp_out + b[:, None] * WIDTH + w[None, :], tl.where(carried[:, None], tl.maximum(prev, 0), mtp), mask=cell)


def carry_forward(carry_rows: torch.Tensor, last_tokens: torch.Tensor, last_ids: torch.Tensor,
                  num_tokens: torch.Tensor, mtp_counts: torch.Tensor, mtp_ids: torch.Tensor,
                  output_index: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """carry_rows, last_ids, num_tokens, mtp_counts, output_index: [B] int64; last_tokens: [max_batch, k+1]
    int64; mtp_ids: [B, k+1] int64 (unit stride along k) -> new (last_ids, num_tokens, mtp_counts, mtp_ids,
    output_index), as engine.worker.decode_round.carry_forward."""
    bsz, width = mtp_ids.shape
    if last_tokens.shape[1] != width or mtp_ids.stride(1) != 1 or last_tokens.stride(1) != 1:
        raise ValueError(f"carry_forward: last_tokens {tuple(last_tokens.shape)} and mtp_ids {tuple(mtp_ids.shape)} "
                         "must both be k+1 wide with unit stride along k")
    outs = [torch.empty_like(t) for t in (last_ids, num_tokens, mtp_counts)]
    mtp_out = torch.empty((bsz, width), dtype=mtp_ids.dtype, device=mtp_ids.device)
    oidx = torch.empty_like(output_index)
    _carry_forward_kernel[(1,)](carry_rows, last_tokens, last_ids, num_tokens, mtp_counts, mtp_ids, output_index,
                                *outs, mtp_out, oidx, bsz, last_tokens.stride(0), mtp_ids.stride(0), WIDTH=width,
                                BLOCK_B=triton.next_power_of_2(max(bsz, 2)),
                                BLOCK_W=triton.next_power_of_2(max(width, 2)), num_warps=4)
    return (*outs, mtp_out, oidx)
