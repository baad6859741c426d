"""Decode and verify attention over paged K/V with TMA page loads: long contexts at batch 1.

Why a second decode kernel. `_attn_kernel` (attention.py) gathers each K/V tile with per-row
pointer loads into registers and waits for it at the top of the loop: a program has one tile in
flight, and latency is hidden only by the other programs resident on its SM. At 32k keys that
route stays at ~0.6 of the copy bandwidth for bf16 pages and ~0.4 for int8 ones, where half the
bytes do not halve the wait (engine/kernels/NOTES.md, "int8 decode" and "Session 13"); registers
bound how many raw tiles a program can carry ahead (`AttnConfig.prefetch`).

Here a key page (PAGE tokens of one KV head, [PAGE, head_dim], contiguous in the page pool) is one
TMA box: `cp.async.bulk.tensor` copies it into shared memory and completes on an mbarrier, with
no address arithmetic in the warps. The page loop is a `tl.range(..., num_stages=S)`, which
Triton software-pipelines: the K and V boxes of the next pages are in flight while this page's
q·k, softmax and p·v run, and they wait in shared memory, not in registers. The block-table entry
that names a page is itself a pipelined load ahead of its box, and Triton 3.6 splits the stages
between the two: S = 5 / 9 / 13 keep 2 / 4 / 6 pages in flight.

Everything else is `_attn_kernel`'s decode path: one program per (KV head, query tile, split),
the GROUP query heads of the KV head packed into BLOCK_M rows, the online softmax in the log2
domain, int8 scales folded into the score and probability columns, the split's partial state
stored and merged by the last split to arrive (`_store_split`). Pages that straddle the causal
diagonal (verify rounds) take the masked pointer path of `_attend_tile` with BLOCK_N = PAGE.

Status: OFF by default (`NINFER_ATTN_DECODE_TMA=1`, or `bf16` / `int8` for one page dtype, turns it on): correct,
and no faster than the pointer kernel's best configuration at any shape measured on the H200 (b1 32k int8 58-70
against 39-45 us a call; engine/kernels/NOTES.md, "Session 21").
A 16-key page per pipeline step is too little work: each step pays two mbarrier waits, a shared-memory round trip
for p and four small MMAs. `AttnConfig.pages_per_step` 4 takes four pages a step under one softmax update: 43.5 us
at bf16 b1 32k, a tie with the pointer kernel's 44.1 ("Session 22"). It stays as the tested base for a
producer-warp version.

Descriptors: one per layer's K and V pool, viewed as [num_pages * PAGE, kv_heads * head_dim] with
box [PAGE, head_dim]; built on the host (`triton.tools.tensor_descriptor`) per call and passed as
kernel parameters, so a CUDA graph captures them by value (the pools never move while it lives).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.worker.forward_context import ForwardContext
from engine.kernels.attention.prefill_tma import LOG2E, TensorDescriptor   # TensorDescriptor: None before Triton 3.4
from engine.kernels.attention.tiles import (_attend_tile, _int8_operand, _online_softmax, _query_tile, _scale_scores,
                                            _split_range, _store_split)
from engine.worker.paged_kv import LayerKV


@triton.jit
def _page_scores(q, k_desc, table_ptr, page_idx, col, ks_ptr, vs_ptr, offs_p, stride_sb, stride_st, shead_off, qk_scale,
                 PAGE: tl.constexpr, QUANT: tl.constexpr, UPCAST: tl.constexpr):
    """The scores of one page: q [BLOCK_M, D] against the page's K box -> (s [BLOCK_M, PAGE] in the log2 domain,
    V's scales [PAGE] (int8 pages), the page id)."""
    blk = tl.load(table_ptr + page_idx)
    k = k_desc.load([blk * PAGE, col])                       # [PAGE, D] page dtype
    if QUANT:
        k = _int8_operand(k, UPCAST)
    s = tl.dot(q, tl.trans(k).to(q.dtype))                   # [BLOCK_M, PAGE] float32
    srow = blk.to(tl.int64) * stride_sb + offs_p * stride_st + shead_off
    s, vs = _scale_scores(s, ks_ptr, vs_ptr, srow, None, qk_scale, QUANT, False)
    return s, vs, blk


@triton.jit
def _page_pv(acc, p, vs, v_desc, blk, col, q, PAGE: tl.constexpr, QUANT: tl.constexpr, UPCAST: tl.constexpr):
    """acc [BLOCK_M, D] (already rescaled) + p @ V of one page, V's int8 scales folded into p's columns."""
    v = v_desc.load([blk * PAGE, col])                       # [PAGE, D]
    if QUANT:
        p = p * vs[None, :]
        v = _int8_operand(v, UPCAST)
    return tl.dot(p.to(q.dtype), v.to(q.dtype), acc)


@triton.jit(do_not_specialize=["tiles_per_seq", "num_splits", "min_pages"])
def _decode_tma_kernel(q_ptr, k_desc, v_desc, k_ptr, v_ptr, ks_ptr, vs_ptr, o_ptr, pacc_ptr, pm_ptr, pl_ptr, cnt_ptr,
                       qsl_ptr, seq_lens_ptr, tables_ptr, qk_scale, tiles_per_seq, num_heads, num_splits, min_pages,
                       stride_qt, stride_qh, stride_ot, stride_oh,
                       stride_pb, stride_pt, stride_ph, stride_sb, stride_st, stride_sh, stride_tab,
                       GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                       PAGE: tl.constexpr, QUANT: tl.constexpr, UPCAST: tl.constexpr, NUM_STAGES: tl.constexpr,
                       PAGES_PER_STEP: tl.constexpr,
                       MERGE: tl.constexpr, MERGE_ROWS: tl.constexpr, MERGE_SPLITS: tl.constexpr):
    # grid: (kv_heads, B * tiles_per_seq, num_splits); every sequence has the same query_len
    kvh = tl.program_id(0)
    pid = tl.program_id(1)
    split = tl.program_id(2)
    seq = pid // tiles_per_seq
    tile = tiles_per_seq - 1 - pid % tiles_per_seq
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len + tile * BLOCK_Q            # position of the tile's first query

    offs_p = tl.arange(0, PAGE)
    offs_d = tl.arange(0, HEAD_DIM)
    q, head, row_ok, q_pos, q_row = _query_tile(q_ptr, q_start, q_len, seq_len, tile, kvh, stride_qt, stride_qh,
                                                GROUP, BLOCK_Q, BLOCK_M, HEAD_DIM)

    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)       # keys after the last query: never seen
    lo, hi, mid, per = _split_range(seq_len, kv_end, first_pos, split, num_splits, min_pages, PAGE)

    table_ptr = tables_ptr + seq.to(tl.int64) * stride_tab
    col = kvh * HEAD_DIM                                     # the KV head's columns in the [rows, heads * D] view
    shead_off = kvh.to(tl.int64) * stride_sh
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)            # finite: fully masked rows stay NaN-free
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if PAGES_PER_STEP == 4:
        # four pages a step under one softmax update: one max, one rescale of acc, the boxes of four pages issued
        # together per pipeline stage (sm_90 SASS: 642 / 1330 instructions per warp per 64 keys, bf16 / int8 at 2
        # warps, against 936 / 1680 for four one-page steps)
        step_end = lo + (mid - lo) // (4 * PAGE) * (4 * PAGE)
        for start in tl.range(lo, step_end, 4 * PAGE, num_stages=NUM_STAGES):
            first = start // PAGE
            s0, vs0, b0 = _page_scores(q, k_desc, table_ptr, first, col, ks_ptr, vs_ptr, offs_p, stride_sb, stride_st,
                                       shead_off, qk_scale, PAGE, QUANT, UPCAST)
            s1, vs1, b1 = _page_scores(q, k_desc, table_ptr, first + 1, col, ks_ptr, vs_ptr, offs_p, stride_sb,
                                       stride_st, shead_off, qk_scale, PAGE, QUANT, UPCAST)
            s2, vs2, b2 = _page_scores(q, k_desc, table_ptr, first + 2, col, ks_ptr, vs_ptr, offs_p, stride_sb,
                                       stride_st, shead_off, qk_scale, PAGE, QUANT, UPCAST)
            s3, vs3, b3 = _page_scores(q, k_desc, table_ptr, first + 3, col, ks_ptr, vs_ptr, offs_p, stride_sb,
                                       stride_st, shead_off, qk_scale, PAGE, QUANT, UPCAST)
            m_new = tl.maximum(tl.maximum(m_i, tl.max(s0, 1)), tl.maximum(tl.max(s1, 1), tl.maximum(tl.max(s2, 1),
                                                                                                  tl.max(s3, 1))))
            alpha = tl.exp2(m_i - m_new)
            p0 = tl.exp2(s0 - m_new[:, None])
            p1 = tl.exp2(s1 - m_new[:, None])
            p2 = tl.exp2(s2 - m_new[:, None])
            p3 = tl.exp2(s3 - m_new[:, None])
            l_i = l_i * alpha + (tl.sum(p0, 1) + tl.sum(p1, 1)) + (tl.sum(p2, 1) + tl.sum(p3, 1))
            m_i = m_new
            acc = acc * alpha[:, None]
            acc = _page_pv(acc, p0, vs0, v_desc, b0, col, q, PAGE, QUANT, UPCAST)
            acc = _page_pv(acc, p1, vs1, v_desc, b1, col, q, PAGE, QUANT, UPCAST)
            acc = _page_pv(acc, p2, vs2, v_desc, b2, col, q, PAGE, QUANT, UPCAST)
            acc = _page_pv(acc, p3, vs3, v_desc, b3, col, q, PAGE, QUANT, UPCAST)
        mid = step_end                                       # whole pages left over go to the masked loop below
    else:
        for start in tl.range(lo, mid, PAGE, num_stages=NUM_STAGES):
            s, vs, blk = _page_scores(q, k_desc, table_ptr, start // PAGE, col, ks_ptr, vs_ptr, offs_p, stride_sb,
                                      stride_st, shead_off, qk_scale, PAGE, QUANT, UPCAST)
            p, alpha, l_i, m_i = _online_softmax(s, m_i, l_i)
            acc = _page_pv(acc * alpha[:, None], p, vs, v_desc, blk, col, q, PAGE, QUANT, UPCAST)
    head_off = kvh.to(tl.int64) * stride_ph
    for start in range(mid, hi, PAGE):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, start, hi, q_pos, table_ptr, k_ptr, v_ptr, ks_ptr,
                                     vs_ptr, head_off, shead_off, stride_pb, stride_pt, stride_sb, stride_st,
                                     qk_scale, offs_p, offs_d, PAGE, QUANT, True, UPCAST)
    _store_split(acc, l_i, m_i, pacc_ptr, pm_ptr, pl_ptr, cnt_ptr, o_ptr, q_start, q_len, q_row, head, row_ok,
                 tile, pid, kvh, split, lo, hi, kv_end, per, num_heads, num_splits, stride_ot, stride_oh,
                 GROUP, BLOCK_Q, HEAD_DIM, MERGE, MERGE_ROWS, MERGE_SPLITS)


def page_descriptors(kv: LayerKV) -> tuple:
    """(K, V) TMA descriptors of one layer's page pools, viewed as [num_pages * PAGE, kv_heads * head_dim]
    with one page of one KV head, [PAGE, head_dim], per box. Not cached: a descriptor holds its pool."""
    pages, page, kvh, d = kv.k.shape
    return tuple(TensorDescriptor.from_tensor(t.view(pages * page, kvh * d), [page, d]) for t in (kv.k, kv.v))


def decode_attention_tma(q: torch.Tensor, kv: LayerKV, ctx: ForwardContext, scale: float, out: torch.Tensor,
                         pages: tuple, *, block_m: int, num_splits: int, min_pages: int, num_warps: int,
                         num_stages: int, pages_per_step: int, upcast: bool, merge: bool, merge_rows: int,
                         merge_block: int, pacc: torch.Tensor, pm: torch.Tensor, pl: torch.Tensor,
                         counters: torch.Tensor) -> torch.Tensor:
    """One split decode/verify call over a uniform query length (attention.paged_attention with
    `AttnConfig.tma_pages`): q [T, heads, head_dim] -> out [T, heads, head_dim]. `pages`: attention.page_args(kv).
    The split partials go to pacc [T, H, S, d], pm, pl [T, H, S], merged here when `merge`, else by the caller."""
    H, d = q.shape[1], q.shape[2]
    kvh, page = kv.k.shape[2], kv.k.shape[1]
    group = H // kvh
    block_q = block_m // group
    tiles_per_seq = -(-ctx.uniform_query_len // block_q)
    k_desc, v_desc = page_descriptors(kv)
    kp, vp, ks, vs, *strides = pages
    _decode_tma_kernel[(kvh, ctx.num_seqs * tiles_per_seq, num_splits)](
        q, k_desc, v_desc, kp, vp, ks, vs, out, pacc, pm, pl, counters, ctx.query_start_loc, ctx.seq_lens,
        ctx.block_tables, scale * LOG2E, tiles_per_seq, H, num_splits, min_pages,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *strides, ctx.block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=d, PAGE=page, QUANT=kv.quantized,
        UPCAST=upcast, NUM_STAGES=num_stages, PAGES_PER_STEP=pages_per_step, MERGE=merge, MERGE_ROWS=merge_rows,
        MERGE_SPLITS=merge_block, num_warps=num_warps, num_stages=num_stages)
    return out
