"""Token -> expert counting sort, each expert's rows padded to a multiple of BLOCK_M (the "align" step of the
fused-MoE design; engine.kernels.moe.reference.align is its twin).

Slot s = t * k + j is token t's j-th choice. Output, all on the device and of sizes fixed by (T, k, E,
BLOCK_M) -- no host read, so the sequence is CUDA-graph capturable:
    sorted_ids  int32 [capacity]              slots grouped by expert (ascending), a stable order inside an
                                              expert, each group padded with the sentinel T * k
    expert_ids  int32 [capacity / BLOCK_M]    the expert of each block of rows (-1 past the used length)
    num_post    int32 [1]                     the used length: sum over experts of roundup(count, BLOCK_M)
Rank of a slot inside its expert: each token picks an expert at most once, so among an expert's slots the
order is the tokens' order, and the rank is an exclusive prefix sum over tokens of the one-hot [T, E] matrix
of their choices (tl.cumsum along tokens).

Two paths:
- few tokens (a [T, E] tile fits one program): one launch routes (engine.kernels.moe.routing.topk_tile) and
  sorts, the fused routing of decode and verify rounds;
- otherwise: routing, then per chunk of tokens a count, one program turning counts into each chunk's base
  offset per expert (and the padding, the block -> expert table, the used length), then per chunk the
  placement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.moe.routing import route, topk_tile

SMALL_TILE = 16384          # [T, E] values one program may hold for the single-launch path
CHUNK_TILE = 8192           # [tokens of a chunk, E] values of the general path's programs


@dataclass(frozen=True)
class SortedSlots:
    sorted_ids: torch.Tensor     # int32 [capacity]
    expert_ids: torch.Tensor     # int32 [capacity // block_m]
    num_post: torch.Tensor       # int32 [1], on the device
    block_m: int
    num_slots: int               # T * k: the sentinel of a padding row


def capacity(num_slots: int, num_experts: int, block_m: int, max_per_expert: int) -> int:
    """The most rows the sort can use: every slot, plus under BLOCK_M of padding per expert hit (at most
    min(E, slots) experts); when no expert can get more than BLOCK_M rows (`max_per_expert`, the tokens),
    one block per expert hit."""
    hit = min(num_experts, num_slots)
    general = triton.cdiv(num_slots + hit * (block_m - 1), block_m) * block_m
    return min(general, hit * block_m) if max_per_expert <= block_m else general


@triton.jit
def _segments(counts, BM: tl.constexpr):
    # counts: int32 [BE] -> (starts, ends, total): each expert's segment padded to a multiple of BM
    padded = (counts + BM - 1) // BM * BM
    ends = tl.cumsum(padded, 0)
    return ends - padded, ends, tl.sum(padded, 0)


@triton.jit
def _write_tables(sorted_ptr, expert_ids_ptr, num_post_ptr, ends, total, cap, max_blocks, sentinel,
                  BM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_B: tl.constexpr):
    # the used length, the sentinel everywhere in sorted_ids, and each block's expert (-1 past the used length)
    tl.store(num_post_ptr, total)
    for s0 in range(0, cap, BLOCK_S):
        offs = s0 + tl.arange(0, BLOCK_S)
        tl.store(sorted_ptr + offs, tl.full((BLOCK_S,), sentinel, tl.int32), mask=offs < cap)
    for b0 in range(0, max_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        first_row = blocks * BM
        expert = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), 1)     # segments ending before it
        tl.store(expert_ids_ptr + blocks, tl.where(first_row < total, expert, -1), mask=blocks < max_blocks)


@triton.jit
def _choices(ids, kcols, j, rows_ok):
    # column j of an ids tile [BT, KP] -> [BT], -1 on absent rows
    return tl.where(rows_ok, tl.sum(tl.where(kcols[None, :] == j, ids, 0), 1), -1)


@triton.jit
def _route_sort_small_kernel(logits_ptr, ids_ptr, w_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
                             T, E, stride_t, cap, max_blocks,
                             K: tl.constexpr, KP: tl.constexpr, RENORM: tl.constexpr, BM: tl.constexpr,
                             BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
                             BLOCK_B: tl.constexpr):
    rows = tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    rows_ok = rows < T
    x = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :], mask=rows_ok[:, None] & (cols[None, :] < E),
                other=float("-inf")).to(tl.float32)
    ids, weights = topk_tile(x, cols, K, KP, RENORM)
    kcols = tl.arange(0, KP)
    out_ok = rows_ok[:, None] & (kcols[None, :] < K)
    tl.store(ids_ptr + rows[:, None] * K + kcols[None, :], ids, mask=out_ok)
    tl.store(w_ptr + rows[:, None] * K + kcols[None, :], weights, mask=out_ok)
    onehot = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)
    for j in tl.static_range(K):
        onehot += (_choices(ids, kcols, j, rows_ok)[:, None] == cols[None, :]).to(tl.int32)
    starts, ends, total = _segments(tl.sum(onehot, 0), BM)
    _write_tables(sorted_ptr, expert_ids_ptr, num_post_ptr, ends, total, cap, max_blocks, T * K, BM, BLOCK_S, BLOCK_B)
    tl.debug_barrier()                              # the sentinel fill is done before the slots land
    rank = tl.cumsum(onehot, 0) - onehot            # earlier tokens that picked the same expert
    for j in tl.static_range(K):
        e = _choices(ids, kcols, j, rows_ok)
        pos = tl.sum(tl.where(cols[None, :] == e[:, None], starts[None, :] + rank, 0), 1)
        tl.store(sorted_ptr + pos, rows * K + j, mask=rows_ok)


@triton.jit
def _chunk_onehot(ids_ptr, c, T, K: tl.constexpr, CT: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = c * CT + tl.arange(0, CT)
    cols = tl.arange(0, BLOCK_E)
    onehot = tl.zeros((CT, BLOCK_E), dtype=tl.int32)
    for j in tl.static_range(K):
        e = tl.load(ids_ptr + rows * K + j, mask=rows < T, other=-1)
        onehot += (e[:, None] == cols[None, :]).to(tl.int32)
    return onehot


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, T, E, K: tl.constexpr, CT: tl.constexpr, BLOCK_E: tl.constexpr):
    c = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    counts = tl.sum(_chunk_onehot(ids_ptr, c, T, K, CT, BLOCK_E), 0)
    tl.store(counts_ptr + c * E + cols, counts, mask=cols < E)


@triton.jit
def _offsets_kernel(counts_ptr, offsets_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, num_chunks, E, cap,
                    max_blocks, sentinel, BM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_B: tl.constexpr):
    cols = tl.arange(0, BLOCK_E)
    ok = cols < E
    totals = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c in range(0, num_chunks):
        totals += tl.load(counts_ptr + c * E + cols, mask=ok, other=0)
    starts, ends, total = _segments(totals, BM)
    base = starts
    for c in range(0, num_chunks):
        tl.store(offsets_ptr + c * E + cols, base, mask=ok)
        base += tl.load(counts_ptr + c * E + cols, mask=ok, other=0)
    _write_tables(sorted_ptr, expert_ids_ptr, num_post_ptr, ends, total, cap, max_blocks, sentinel, BM, BLOCK_S, BLOCK_B)


@triton.jit
def _place_kernel(ids_ptr, offsets_ptr, sorted_ptr, T, E, K: tl.constexpr, CT: tl.constexpr, BLOCK_E: tl.constexpr):
    c = tl.program_id(0)
    rows = c * CT + tl.arange(0, CT)
    cols = tl.arange(0, BLOCK_E)
    onehot = _chunk_onehot(ids_ptr, c, T, K, CT, BLOCK_E)
    base = tl.load(offsets_ptr + c * E + cols, mask=cols < E, other=0)
    rank = tl.cumsum(onehot, 0) - onehot
    for j in tl.static_range(K):
        e = tl.load(ids_ptr + rows * K + j, mask=rows < T, other=-1)
        pos = tl.sum(tl.where(cols[None, :] == e[:, None], base[None, :] + rank, 0), 1)
        tl.store(sorted_ptr + pos, rows * K + j, mask=rows < T)


def _buffers(T: int, k: int, num_experts: int, block_m: int, device):
    cap = capacity(T * k, num_experts, block_m, T)
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=device)
    expert_ids = torch.empty(cap // block_m, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    return cap, sorted_ids, expert_ids, num_post


def sort_slots(ids: torch.Tensor, num_experts: int, block_m: int) -> SortedSlots:
    """ids: int32 [T, k] -> the slots sorted by expert and padded (the general path: three launches)."""
    T, k = ids.shape
    cap, sorted_ids, expert_ids, num_post = _buffers(T, k, num_experts, block_m, ids.device)
    be = triton.next_power_of_2(num_experts)
    ct = max(1, min(128, CHUNK_TILE // be))
    chunks = triton.cdiv(T, ct)
    counts = torch.empty(chunks, num_experts, dtype=torch.int32, device=ids.device)
    offsets = torch.empty_like(counts)
    _count_kernel[(chunks,)](ids, counts, T, num_experts, K=k, CT=ct, BLOCK_E=be)
    _offsets_kernel[(1,)](counts, offsets, sorted_ids, expert_ids, num_post, chunks, num_experts, cap,
                          expert_ids.numel(), T * k, BM=block_m, BLOCK_E=be, BLOCK_S=1024, BLOCK_B=64)
    _place_kernel[(chunks,)](ids, offsets, sorted_ids, T, num_experts, K=k, CT=ct, BLOCK_E=be)
    return SortedSlots(sorted_ids, expert_ids, num_post, block_m, T * k)


def route_and_sort(logits: torch.Tensor, top_k: int, renormalize: bool,
                   block_m: int) -> tuple[torch.Tensor, torch.Tensor, SortedSlots]:
    """logits: [T, E] -> (ids int32 [T, k], weights float32 [T, k], the sorted slots): one launch when the
    [T, E] tile fits a program, else routing then `sort_slots`."""
    T, E = logits.shape
    bt, be = triton.next_power_of_2(T), triton.next_power_of_2(E)
    if bt * be > SMALL_TILE:
        ids, weights = route(logits, top_k, renormalize)
        return ids, weights, sort_slots(ids, E, block_m)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    cap, sorted_ids, expert_ids, num_post = _buffers(T, top_k, E, block_m, logits.device)
    _route_sort_small_kernel[(1,)](logits, ids, weights, sorted_ids, expert_ids, num_post, T, E, logits.stride(0), cap,
                                   expert_ids.numel(), K=top_k, KP=triton.next_power_of_2(top_k), RENORM=renormalize,
                                   BM=block_m, BLOCK_T=bt, BLOCK_E=be, BLOCK_S=256, BLOCK_B=64,
                                   num_warps=4 if bt * be <= 4096 else 8)
    return ids, weights, SortedSlots(sorted_ids, expert_ids, num_post, block_m, T * top_k)
