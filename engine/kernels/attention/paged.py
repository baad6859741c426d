"""Paged attention on the GPU: the KV write and one attention kernel for prefill, decode and verify.

The torch twins are `write_kv_reference` and `paged_attention_reference` in
`engine.layers.attention`; tests/test_kernels_*.py hold each kernel to its twin.

One kernel serves every shape. A program owns one *tile*: up to BLOCK_Q consecutive new tokens of
one sequence times the GROUP query heads that share one KV head, packed into BLOCK_M = BLOCK_Q *
GROUP rows, so each K/V tile is loaded once for the whole group (the packing of vLLM's Triton
"unified attention" kernel). It walks that sequence's pages BLOCK_N keys at a time with the online
softmax of FlashAttention (Dao et al.): first the tiles that every row of the tile sees whole (no
mask), then the few that straddle the causal diagonal (masked); tiles past the diagonal are never
loaded.

Prefill-shaped calls with host lengths on an sm90 GPU mostly leave this file: their keys are gathered into
contiguous K/V (int8 pages dequantized on the way) for the TMA kernel of prefill_tma.py, all at once or,
for one long sequence, segment by segment (`takes_tma_prefill`, `prefill_segment_keys`). The rest (short chunks
after long contexts, graphs, other GPUs) use BLOCK_M = 128 here and one program per tile. Decode and verify
(query_len * GROUP <= 128 rows) split each sequence's keys over `num_splits` programs and merge the
partial softmax states (split-K "flash-decoding", Dao et al.), so that batch-1 decode at long context
still covers every SM: the last split of a tile to finish merges them (an arrival counter per tile and
KV head, `AttnConfig.fused_merge`), where a long prefill's splits take a second kernel. For those
shapes the grid and the split count depend on tensor shapes and the context's length bound only
(`ctx.max_seq_len`: a length class when graphed), never on each sequence's length: the call is
CUDA-graph capturable, and each program works out its own key range from `seq_lens` on the device
(splits past the end of a short sequence find an empty range and only record that).

Decode/verify switches (`AttnConfig`, swept by tools/dev/tune_decode_attention.py --variants): `prefetch`
software-pipelines the whole-tile loop (the next tile's loads issued before this tile's math); plans take
it for one-tile splits, for int8 pages at long contexts and for 16-bit pages split 32 ways or more (batch 1-2
at long contexts, registers capped so four programs share an SM).

int8 pages are read as int8 and converted in registers: K's per-token scale multiplies the score
column after the q·k product, V's scale multiplies the probability column before p·v. Decode and
verify plans (bf16 q) convert each tile with a few PTX instructions that Triton cannot see through
(`_int8_operand`, `AttnConfig.int8_upcast`), so the MMAs get the operand layouts of bf16 pages
rather than Triton's 8-bit ones (docs/kernels.md, "Attention").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine import envs
from engine.platform import paths_for
from engine.worker.forward_context import ForwardContext
from engine.kernels.tuned import load_tuned
from engine.kernels.attention.tiles import (_accumulate_pv, _attend_tile, _int8_operand, _online_softmax, _query_tile,
                                            _split_range, _store_split, _unmasked_end)
from engine.worker.paged_kv import PREFILL_GATHER_MAX_BYTES, PREFILL_TMA_HEAD_DIMS, LayerKV, gather_kv

LOG2E = 1.4426950408889634
DECODE_MAX_ROWS = 128      # query_len * group up to this takes the split (graph-safe) plan
MAX_SPLITS = 64             # prefill-shaped calls
# decode/verify: enough splits that one sequence over few KV heads (Qwen3.5-27B: 2 per TP=2 rank)
# still fills the GPU at long contexts
MAX_DECODE_SPLITS = 256
DECODE_MIN_SPLIT_KEYS = 64    # one 64-key tile: short contexts split down to a tile per program
# Decode and verify plans merge their splits inside the attention kernel (AttnConfig.fused_merge): served qwen3-8b
# at ctx 512, k=0 4.216 -> 4.172 ms, NVFP4 step 2.758 -> 2.725, two interleaved reps each
# (bench/results/2026-12-02-h200-fused-merge-kv-32b/b-5388838-ab-fused-merge), where _merge_kernel had taken 0.117 ms a step.
# NINFER_ATTN_FUSED_MERGE=0 gives the second kernel back.
FUSED_MERGE = envs.ATTN_FUSED_MERGE.read()
MERGE_TILE_FLOATS = 8192      # a fused merge's [rows, splits, head_dim] fp32 trip: 64 registers a thread at 4 warps
MERGE_COUNTERS = 1 << 16      # (tile, KV head) arrival counters per device
_MERGE_COUNTERS: dict[tuple, torch.Tensor] = {}


# -- KV write ------------------------------------------------------------------------------------

@triton.jit
def _round_half_even(y):
    # torch.round on float32 (ties to even), exact for |y| < 2**22; tl.floor works on every backend
    # and in the interpreter, where libdevice.rint does not.
    f = tl.floor(y)
    frac = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return f + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)


@triton.jit
def _store_kv_token(x1, x2, page_ptr, scale_ptr, slot, offs_h, half, mask_h,
                    stride_pb, stride_pt, stride_ph, stride_sb, stride_st, stride_sh,
                    HALF: tl.constexpr, PAGE: tl.constexpr, QUANT: tl.constexpr):
    """Store one token's heads into `slot` (< 0: nothing). The rows come as two float32 halves
    x1, x2 [HEADS, HALF] (columns [0, HALF) and [HALF, 2 * HALF)), the form RoPE produces them in.

    int8 pages: symmetric per-head quantization exactly as `quantize_int8` does it (IEEE divisions,
    ties to even), so the stored bytes equal the reference's.
    """
    keep = mask_h & (slot >= 0)
    blk = (slot // PAGE).to(tl.int64)
    off = slot % PAGE
    ptrs = page_ptr + blk * stride_pb + off * stride_pt + offs_h[:, None] * stride_ph + half[None, :]
    if QUANT:
        amax = tl.maximum(tl.max(tl.abs(x1), axis=1), tl.max(tl.abs(x2), axis=1))
        scale = tl.math.div_rn(tl.maximum(amax, 1e-8), tl.full(amax.shape, 127.0, tl.float32))
        per_elem = scale[:, None] + tl.zeros_like(x1)             # div_rn does not broadcast
        y1 = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(x1, per_elem)), -127.0), 127.0)
        y2 = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(x2, per_elem)), -127.0), 127.0)
        tl.store(ptrs, y1.to(tl.int8), mask=keep[:, None])
        tl.store(ptrs + HALF, y2.to(tl.int8), mask=keep[:, None])
        tl.store(scale_ptr + blk * stride_sb + off * stride_st + offs_h * stride_sh, scale, mask=keep)
    else:
        tl.store(ptrs, x1.to(page_ptr.dtype.element_ty), mask=keep[:, None])
        tl.store(ptrs + HALF, x2.to(page_ptr.dtype.element_ty), mask=keep[:, None])


@triton.jit
def _load_halves(ptr, offs_h, half, mask_h, stride_h, HALF: tl.constexpr):
    # rows of [HEADS, 2 * HALF] at ptr (head stride stride_h) -> two float32 halves [HEADS, HALF]
    p = ptr + offs_h[:, None] * stride_h + half[None, :]
    x1 = tl.load(p, mask=mask_h[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=mask_h[:, None], other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, slot_ptr, kp_ptr, vp_ptr, ks_ptr, vs_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_pb, stride_pt, stride_ph, stride_sb, stride_st, stride_sh,
                     KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
                     PAGE: tl.constexpr, QUANT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    offs_h = tl.arange(0, HEADS_PAD)
    half = tl.arange(0, HALF)
    mask_h = (offs_h < KV_HEADS) & (slot >= 0)
    k1, k2 = _load_halves(k_ptr + t * stride_kt, offs_h, half, mask_h, stride_kh, HALF)
    v1, v2 = _load_halves(v_ptr + t * stride_vt, offs_h, half, mask_h, stride_vh, HALF)
    _store_kv_token(k1, k2, kp_ptr, ks_ptr, slot, offs_h, half, mask_h,
                    stride_pb, stride_pt, stride_ph, stride_sb, stride_st, stride_sh, HALF, PAGE, QUANT)
    _store_kv_token(v1, v2, vp_ptr, vs_ptr, slot, offs_h, half, mask_h,
                    stride_pb, stride_pt, stride_ph, stride_sb, stride_st, stride_sh, HALF, PAGE, QUANT)


def page_args(kv: LayerKV) -> tuple:
    """(k pages, v pages, k scales, v scales, 6 strides) as the kernels take them; checks the layout."""
    if kv.k.stride() != kv.v.stride():
        raise ValueError(f"K and V pages must share one layout, got strides {kv.k.stride()} and {kv.v.stride()}")
    if kv.k.stride(-1) != 1:
        raise ValueError("KV pages need a contiguous head_dim")
    if kv.quantized:
        if kv.k_scale is None or kv.v_scale is None or kv.k_scale.stride() != kv.v_scale.stride():
            raise ValueError("int8 pages need k_scale and v_scale of one layout")
        ks, vs, sstr = kv.k_scale, kv.v_scale, kv.k_scale.stride()
    else:
        ks, vs, sstr = kv.k, kv.v, (0, 0, 0)        # placeholders, never read
    return (kv.k, kv.v, ks, vs, *kv.k.stride()[:3], *sstr)


def _check_head_dim(d: int) -> None:
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")


def write_kv(kv: LayerKV, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new K/V into their slots (slot -1: skipped), quantizing when the pages are int8.

    k, v: [T, kv_heads, head_dim] (any float dtype, head_dim contiguous); slot_mapping: [T] int.
    One launch for K and V, grid (T,): CUDA-graph capturable.
    """
    T, kvh, d = k.shape
    _check_head_dim(d)
    if T == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need a contiguous head_dim")
    kp, vp, ks, vs, *strides = page_args(kv)
    slot_mapping = slot_mapping.contiguous()
    _write_kv_kernel[(T,)](
        k, v, slot_mapping, kp, vp, ks, vs, k.stride(0), k.stride(1), v.stride(0), v.stride(1), *strides,
        KV_HEADS=kvh, HEADS_PAD=triton.next_power_of_2(kvh), HALF=d // 2, PAGE=kv.k.shape[1],
        QUANT=kv.quantized, num_warps=4 if kvh * d >= 1024 else 2)


# -- attention -----------------------------------------------------------------------------------

@triton.jit
def _table_rows(table_ptr, start, end, offs_n, PAGE: tl.constexpr):
    """Page ids [BLOCK_N] of keys start + offs_n, as stored (int32: half the registers of int64 while
    they wait a tile in the pipeline); 0 past `end` (a prefetch past the loop)."""
    return tl.load(table_ptr + (start + offs_n) // PAGE, mask=start < end, other=0)


@triton.jit
def _load_k_tile(blk, start, end, k_ptr, ks_ptr, vs_ptr, head_off, shead_off, stride_pb, stride_pt, stride_sb,
                 stride_st, offs_n, offs_d, PAGE: tl.constexpr, QUANT: tl.constexpr):
    """Raw K [D, BLOCK_N] (page dtype) and, int8 pages, the K and V scales [BLOCK_N] of the whole tile
    at `start` (blk: its page ids). Nothing is read when start >= end (a prefetch past the loop): one
    scalar predicate, so the loads stay as wide as unmasked ones."""
    live = start < end
    blk = blk.to(tl.int64)
    in_page = (start + offs_n) % PAGE
    row = blk * stride_pb + in_page * stride_pt + head_off
    k = tl.load(k_ptr + row[None, :] + offs_d[:, None], mask=live, other=0.0)
    if QUANT:
        srow = blk * stride_sb + in_page * stride_st + shead_off
        ks = tl.load(ks_ptr + srow, mask=live, other=0.0)
        vs = tl.load(vs_ptr + srow, mask=live, other=0.0)
    else:
        ks = tl.zeros([offs_n.shape[0]], tl.float32)              # placeholders, never read
        vs = ks
    return k, ks, vs


@triton.jit
def _load_v_tile(blk, start, end, v_ptr, head_off, stride_pb, stride_pt, offs_n, offs_d, PAGE: tl.constexpr):
    """Raw V [BLOCK_N, D] (page dtype) of the whole tile at `start`, as `_load_k_tile`."""
    row = blk.to(tl.int64) * stride_pb + ((start + offs_n) % PAGE) * stride_pt + head_off
    return tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=start < end, other=0.0)


@triton.jit
def _attend_loaded(acc, l_i, m_i, q, k, v, ks, vs, qk_scale, QUANT: tl.constexpr, UPCAST: tl.constexpr):
    """The math of one whole (unmasked) tile whose raw K/V (and scales) are already in registers:
    the same steps as `_attend_tile`'s unmasked branch."""
    if QUANT:
        k = _int8_operand(k, UPCAST)
    s = tl.dot(q, k.to(q.dtype))                                  # [BLOCK_M, BLOCK_N] float32
    if QUANT:
        s = s * (ks * qk_scale)[None, :]
    else:
        s = s * qk_scale
    p, alpha, l_i, m_new = _online_softmax(s, m_i, l_i)
    return _accumulate_pv(acc, alpha, p, v, vs, q, QUANT, UPCAST), l_i, m_new


@triton.jit(do_not_specialize=["num_seqs", "tiles_per_seq", "num_splits", "min_tiles"])
def _attn_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, o_ptr, pacc_ptr, pm_ptr, pl_ptr, cnt_ptr,
                 qsl_ptr, seq_lens_ptr, tables_ptr, qk_scale, num_seqs, tiles_per_seq, num_heads,
                 num_splits, min_tiles,
                 stride_qt, stride_qh, stride_ot, stride_oh,
                 stride_pb, stride_pt, stride_ph, stride_sb, stride_st, stride_sh, stride_tab,
                 GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, QUANT: tl.constexpr, SPLIT: tl.constexpr,
                 UPCAST: tl.constexpr, PREFETCH: tl.constexpr = 0, MERGE: tl.constexpr = False,
                 MERGE_ROWS: tl.constexpr = 16, MERGE_SPLITS: tl.constexpr = 4):
    # grid: (kv_heads, tiles, num_splits); kv head fastest so the heads of one tile run together
    kvh = tl.program_id(0)
    pid = tl.program_id(1)
    split = tl.program_id(2)
    if tiles_per_seq > 0:
        # every sequence has the same query_len: tiles_per_seq tiles each, the longest first
        seq = pid // tiles_per_seq
        tile = tiles_per_seq - 1 - pid % tiles_per_seq
    else:
        # sequence i owns programs [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1): enough for
        # its ceil(query_len / BLOCK_Q) tiles with no host-built map; find i by bisection
        lo_s = num_seqs * 0
        hi_s = num_seqs
        while hi_s - lo_s > 1:
            mid_s = (lo_s + hi_s) // 2
            first = tl.load(qsl_ptr + mid_s) // BLOCK_Q + mid_s
            lo_s = tl.where(first <= pid, mid_s, lo_s)
            hi_s = tl.where(first <= pid, hi_s, mid_s)
        seq = lo_s
        tile = pid - (tl.load(qsl_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len + tile * BLOCK_Q            # position of the tile's first query

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q, head, row_ok, q_pos, q_row = _query_tile(q_ptr, q_start, q_len, seq_len, tile, kvh, stride_qt, stride_qh,
                                                GROUP, BLOCK_Q, BLOCK_M, HEAD_DIM)

    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)       # keys after the last query: never seen
    if SPLIT:
        lo, hi, mid, per = _split_range(seq_len, kv_end, first_pos, split, num_splits, min_tiles, BLOCK_N)
    else:
        lo = 0
        hi = kv_end
        mid = _unmasked_end(lo, hi, first_pos, BLOCK_N)

    table_ptr = tables_ptr + seq.to(tl.int64) * stride_tab
    head_off = kvh.to(tl.int64) * stride_ph
    shead_off = kvh.to(tl.int64) * stride_sh
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)            # finite: fully masked rows stay NaN-free
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if PREFETCH > 0:
        # Software pipeline over the whole tiles: a program issues the loads of the next tile before it
        # does this tile's math, so it always has bytes in flight while it computes, instead of waiting
        # at the loop top for the tile it is about to use (the latency bound of docs/kernels.md, "Attention").
        # The page ids run one tile further ahead, so no K/V load waits on a table load either.
        # int8 tiles stay raw bytes until their math (the in-register conversion needs them in
        # registers, which is why num_stages cannot multi-buffer them).
        #   PREFETCH 1: K (and the scales) of tile i + 1 and V of tile i are issued at the top of tile
        #               i, so V's latency hides behind q.k and the softmax; one raw tile carried.
        #   PREFETCH 2: K and V of tile i + 1; two raw tiles carried.
        # Registers (ptxas, sm_90, BLOCK_M 16, 4 warps, 64-key int8 tiles): 128 without, 158 with
        # PREFETCH 1 (3 programs per SM), 213 with 2; `AttnConfig.max_regs` trades that back for spills.
        blk_c = _table_rows(table_ptr, lo, mid, offs_n, PAGE)
        k_c, ks_c, vs_c = _load_k_tile(blk_c, lo, mid, k_ptr, ks_ptr, vs_ptr, head_off, shead_off, stride_pb,
                                       stride_pt, stride_sb, stride_st, offs_n, offs_d, PAGE, QUANT)
        if PREFETCH > 1:
            v_c = _load_v_tile(blk_c, lo, mid, v_ptr, head_off, stride_pb, stride_pt, offs_n, offs_d, PAGE)
        blk_n = _table_rows(table_ptr, lo + BLOCK_N, mid, offs_n, PAGE)
        for start in range(lo, mid, BLOCK_N):
            if PREFETCH == 1:
                v_c = _load_v_tile(blk_c, start, mid, v_ptr, head_off, stride_pb, stride_pt, offs_n, offs_d, PAGE)
            k_n, ks_n, vs_n = _load_k_tile(blk_n, start + BLOCK_N, mid, k_ptr, ks_ptr, vs_ptr, head_off, shead_off,
                                           stride_pb, stride_pt, stride_sb, stride_st, offs_n, offs_d, PAGE, QUANT)
            if PREFETCH > 1:
                v_n = _load_v_tile(blk_n, start + BLOCK_N, mid, v_ptr, head_off, stride_pb, stride_pt, offs_n,
                                   offs_d, PAGE)
            blk_c = blk_n
            blk_n = _table_rows(table_ptr, start + 2 * BLOCK_N, mid, offs_n, PAGE)
            acc, l_i, m_i = _attend_loaded(acc, l_i, m_i, q, k_c, v_c, ks_c, vs_c, qk_scale, QUANT, UPCAST)
            k_c, ks_c, vs_c = k_n, ks_n, vs_n
            if PREFETCH > 1:
                v_c = v_n
    else:
        for start in range(lo, mid, BLOCK_N):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, start, hi, q_pos, table_ptr, k_ptr, v_ptr, ks_ptr,
                                         vs_ptr, head_off, shead_off, stride_pb, stride_pt, stride_sb, stride_st,
                                         qk_scale, offs_n, offs_d, PAGE, QUANT, False, UPCAST)
    for start in range(mid, hi, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, start, hi, q_pos, table_ptr, k_ptr, v_ptr, ks_ptr,
                                     vs_ptr, head_off, shead_off, stride_pb, stride_pt, stride_sb, stride_st,
                                     qk_scale, offs_n, offs_d, PAGE, QUANT, True, UPCAST)

    if SPLIT:
        _store_split(acc, l_i, m_i, pacc_ptr, pm_ptr, pl_ptr, cnt_ptr, o_ptr, q_start, q_len, q_row, head, row_ok,
                     tile, pid, kvh, split, lo, hi, kv_end, per, num_heads, num_splits, stride_ot, stride_oh,
                     GROUP, BLOCK_Q, HEAD_DIM, MERGE, MERGE_ROWS, MERGE_SPLITS)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(pacc_ptr, pm_ptr, pl_ptr, o_ptr, num_heads, num_splits, stride_ot, stride_oh,
                  SPLITS_PAD: tl.constexpr, SPLIT_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """out[t, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the key-range splits, the
    partial accumulators summed SPLIT_BLOCK splits at a time (256 splits x head_dim 256 would not fit
    in registers at once).

    An empty split (l = 0) never wrote its accumulator rows: whatever they hold (NaN included) is
    dropped by a select, not by a mask on the load, so the accumulators load in the same memory trip
    as m and l rather than one after l arrives, and no NaN * 0 reaches the sum."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    base = (t * num_heads + h) * num_splits
    ok = offs_s < num_splits
    m = tl.load(pm_ptr + base + offs_s, mask=ok, other=-1.0e30)
    l = tl.load(pl_ptr + base + offs_s, mask=ok, other=0.0)
    out = tl.zeros([HEAD_DIM], tl.float32)
    if SPLIT_BLOCK == SPLITS_PAD:
        # every split in one block: m, l and the accumulators in one trip
        acc = tl.load(pacc_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0)
        acc = tl.where((l > 0)[:, None], acc, 0.0)
        top = tl.max(m, 0)
        denom = tl.sum(tl.exp2(m - top) * l, 0)
        out += tl.sum(acc * tl.exp2(m - top)[:, None], 0)
    else:
        top = tl.max(m, 0)
        denom = tl.sum(tl.exp2(m - top) * l, 0)
        for s0 in range(0, num_splits, SPLIT_BLOCK):
            sb = s0 + tl.arange(0, SPLIT_BLOCK)
            okb = sb < num_splits
            mb = tl.load(pm_ptr + base + sb, mask=okb, other=-1.0e30)
            lb = tl.load(pl_ptr + base + sb, mask=okb, other=0.0)
            acc = tl.load(pacc_ptr + (base + sb)[:, None] * HEAD_DIM + offs_d[None, :], mask=okb[:, None], other=0.0)
            acc = tl.where((lb > 0)[:, None], acc, 0.0)
            out += tl.sum(acc * tl.exp2(mb - top)[:, None], 0)
    out = out / denom
    tl.store(o_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty))


@dataclass(frozen=True)
class AttnConfig:
    """Launch shape of one attention call. `num_splits` 1 = no split (no merge kernel)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int = 1
    min_tiles: int = 2          # a split covers at least this many BLOCK_N key tiles
    int8_upcast: bool = False   # int8 pages, bf16 q: K/V tiles converted in registers (see _int8_operand)
    # software pipeline of the whole-tile loop (see the kernel): 0 off; 1 the next tile's K (and scales)
    # and this tile's V loaded before this tile's math; 2 the next tile's K and V. Meant for num_stages 1
    prefetch: int = 0
    # ptxas register cap per thread (0: the compiler's choice); e.g. 128 keeps 4 programs of 4 warps per SM
    # where a prefetching shape would take ~160 (3 per SM). CUDA only: the interpreter ignores it
    max_regs: int = 0
    # split plans: the last split of a tile to finish merges the partials itself (_merge_tile), so a call is one
    # launch rather than the attention kernel and _merge_kernel
    fused_merge: bool = False


# Defaults, per call shape; tools/dev/gpu_kernel_suite.py sweeps the alternatives on the H200.
# Picked from the sweep of tools/dev/gpu_kernel_suite.py on the H200 (bench/results/2026-11-30-h200/kernels-run1.json):
# prefill bn128/s3 was fastest at context 0 and after 28k; decode s2 at 32k.
PREFILL = dict(block_m=128, block_n=128, num_warps=8, num_stages=3)
DECODE = dict(block_n=64, num_warps=4, num_stages=2, min_tiles=1)
# head_dim 256: half the tile sizes in both directions, two stages (see `plan`)
PREFILL_HD256 = dict(block_m=64, block_n=64, num_warps=8, num_stages=2)
# Decode over int8 pages with bf16 q: K/V converted in registers (int8_upcast), no cp.async stage
# (num_stages 1); 128 registers for sm_90, 44 warp-instructions per key (its sm_90 SASS). Short
# contexts add prefetch 1 (one-tile splits); long ones take INT8_LONG's 128-key tiles (below).
DECODE_INT8 = {"block_n": 64, "num_warps": 4, "num_stages": 1, "min_tiles": 1, "int8_upcast": True}


# int8 pages over long contexts (splits of several tiles): 128-key tiles, the next tile's K loaded before this
# tile's math (prefetch 1), and at most 2 programs per SM (249 registers for sm_90: a third would start a second
# wave). Measured for 16-row tiles only (decode; verify up to 4 tokens at group 4): larger tiles keep DECODE_INT8.
# H200, us per call (bench/results/2026-12-02-h200-kv-int8-long/b-f5f35af-decode-tma): b1 32k 45.0 -> 39.1, b1 8k 18.1 ->
# 15.1, b8 8k 72.1 -> 70.1, b8 32k 263.9 -> 257.3; served int8 KV at 32k 5.668 -> 5.504 ms a step
# (bench/results/2026-12-02-h200-kv-int8-long/c-d8e4bed-kv-int8-long). NINFER_ATTN_INT8_LONG=0 keeps the 64-key plan.
# Its shape (prefetch, warps, programs per SM) is tools/dev/tune_decode_attention.py --variants --write's pick at batch 1
# over the longest context, kept in tuned/h200.json (section "decode_int8_long", naming the run): the other shapes of
# the tuner lost at b1 32k (no prefetch at 4 warps 42.6 us, at 8 warps 48.0, prefetch at 8 warps 57.6, against 39.5),
# and so did the 64-key plan with prefetch (50.2-58.8 us; bench/results/2026-12-02-h200-preload-quant-8b/
# a-295b648-gpu-tests-int8-tune). Without the file the shape is off, as with NINFER_ATTN_INT8_LONG=0.
_INT8_LONG_TUNED = load_tuned(__file__, "decode_int8_long", {})
INT8_LONG = envs.ATTN_INT8_LONG.read() and bool(_INT8_LONG_TUNED)
INT8_LONG_PREFETCH, INT8_LONG_WARPS, INT8_LONG_PROGRAMS_PER_SM = (
    _INT8_LONG_TUNED.get(key) for key in ("prefetch", "num_warps", "programs_per_sm"))


# 16-bit pages, split decode at small batch past one-tile splits: the next tile's K loaded before this tile's
# math, registers capped at 128 so four programs share an SM (the plan's 512 programs of a batch-1 step in one
# wave). H200, qwen3-8b, us per call (bench/results/2026-12-02-h200-long-prefill-seed/b-e7e238c-tune-seed): b1 32k 53.3 -> 44.1,
# b1 8k 22.0 -> 18.4 (64 splits); at b8 8k (8 splits, already 0.90 of the byte floor) it lost, 70.2 -> 71.5. Served
# bf16 KV at 32k 5.891 -> 5.571 ms a step (bench/results/2026-12-02-h200-long-prefill-seed/f-5089f29-kv-ab-bf16-long). The rule
# reads the split count, not keys per split: a graph's plan sees its context class (the engine's maximum past 16k),
# not the length it replays at. NINFER_ATTN_BF16_LONG=0 keeps the cp.async pipeline. The shape is the tuner's pick at
# batch 1 over the longest context (tuned/h200.json, section "decode_bf16_long"); without the file it is off.
_BF16_LONG_TUNED = load_tuned(__file__, "decode_bf16_long", {})
BF16_LONG = envs.ATTN_BF16_LONG.read() and bool(_BF16_LONG_TUNED)
BF16_LONG_SHAPE = {key: _BF16_LONG_TUNED.get(key) for key in ("prefetch", "num_stages", "max_regs")}
BF16_LONG_MIN_SPLITS = 32


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132                                  # the interpreter: plan as for an H200
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def plan(q: torch.Tensor, kv: LayerKV, ctx: ForwardContext) -> AttnConfig:
    """Pick the launch shape from host ints only (no device read).

    Decode/verify shapes (query_len * group <= DECODE_MAX_ROWS) look at tensor shapes, the batch size
    and ctx.max_seq_len (a length class when graphed) alone, so a CUDA graph captured once replays right
    for any seq_lens within its class, and eager and graphed runs of one class take the same plan.
    Prefill shapes (never captured) read ctx.max_seq_len to decide whether splitting the keys pays (few
    query tiles over a long context).
    """
    T, H, d = q.shape
    kvh = kv.k.shape[2]
    group = H // kvh
    q_len = ctx.uniform_query_len if ctx.uniform_query_len is not None else ctx.max_query_len
    sms = sm_count(q.device)
    if q_len * group <= DECODE_MAX_ROWS:
        block_m = max(16, triton.next_power_of_2(q_len * group))
        ctas = _num_tiles(T, ctx, block_m // group)[1] * kvh
        # ctx.max_seq_len bounds every sequence (exact when eager; a length class when graphed).
        # Splits go down to one tile each: a program's key loop is a chain of dependent loads, so at
        # short contexts many one-tile programs beat a few that walk several tiles (H200, qwen3-8b, b1:
        # ctx 512 10.7 -> 6.2 us per call with its merge, ctx 2048 13.1 -> 9.3; tools/dev/tune_decode_attention.py)
        useful = max(1, -(-ctx.max_seq_len // DECODE_MIN_SPLIT_KEYS))
        splits = 1
        while splits * 2 <= min(MAX_DECODE_SPLITS, triton.next_power_of_2(useful)) and ctas * splits * 2 <= 4 * sms:
            splits *= 2
        # 128 rows in 4 warps spill registers (seen in ptxas for sm_90): 8 warps there
        base = DECODE_INT8 if kv.quantized and q.dtype == torch.bfloat16 else DECODE
        cfg = dict(base, num_warps=4 if block_m <= 64 else 8)
        if splits * cfg["block_n"] >= ctx.max_seq_len and block_m <= 64 and d <= 128 and (
                not kv.quantized or base is DECODE_INT8):
            # every split is one tile: issue its K and V loads together rather than V after q.k (the
            # pipelined loop's prologue). int8 carries K only (prefetch 1): 158 registers, 3 programs per SM;
            # int8 pages without the in-register conversion (fp16 q) keep their old route
            cfg.update(prefetch=1 if kv.quantized else 2, num_stages=1)
        if INT8_LONG and base is DECODE_INT8 and not cfg.get("prefetch") and block_m == 16 and d <= 128:
            cfg.update(block_n=128, prefetch=INT8_LONG_PREFETCH, num_stages=1, num_warps=INT8_LONG_WARPS)
            while splits > 1 and ctas * splits > INT8_LONG_PROGRAMS_PER_SM * sms:
                splits //= 2
        elif (BF16_LONG and base is DECODE and kv.k.element_size() == 2 and q.element_size() == 2
              and not cfg.get("prefetch") and block_m == 16 and d <= 128 and splits >= BF16_LONG_MIN_SPLITS):
            cfg.update(BF16_LONG_SHAPE)
        return AttnConfig(block_m=block_m, num_splits=splits, fused_merge=FUSED_MERGE and splits > 1, **cfg)
    block_m = max(PREFILL["block_m"], triton.next_power_of_2(group))
    ctas = _num_tiles(T, ctx, block_m // group)[1] * kvh
    splits, min_keys = 1, 2048
    # split only when the tiles leave SMs idle: at 1-2 programs per SM a split adds a merge pass and a
    # second wave (qwen3-8b chunk 1024 after 16k: the merge was 7 % of the prefill's attention)
    while splits * 2 <= MAX_SPLITS and ctas * splits < sms and ctx.max_seq_len >= splits * 2 * min_keys:
        splits *= 2
    cfg = dict(PREFILL, block_m=block_m)
    if d >= 256:
        # head_dim 256 (Qwen3.5's gated attention): 128 x 128 tiles in 3 stages ask ~320 KB of shared
        # memory (the H200 has 227 KB per block) and a 128 x 256 float32 accumulator spills
        cfg.update(PREFILL_HD256, block_m=max(PREFILL_HD256["block_m"], triton.next_power_of_2(group)))
    if q.element_size() > 2:
        # float32 tiles are twice as large: the bf16 tiles and stages would not fit shared memory
        cfg.update(block_n=32 if d < 256 else 16, num_stages=2)
    return AttnConfig(num_splits=splits, min_tiles=min_keys // cfg["block_n"], **cfg)


def _num_tiles(T: int, ctx: ForwardContext, block_q: int) -> tuple[int, int]:
    """(tiles_per_seq, programs along the tile axis). Uniform batches: B * ceil(q / BLOCK_Q) exactly;
    otherwise T // BLOCK_Q + B, the bound the kernel's bisection map fits in."""
    if ctx.uniform_query_len is not None:
        per = -(-ctx.uniform_query_len // block_q)
        return per, ctx.num_seqs * per
    return 0, T // block_q + ctx.num_seqs


def paged_attention(q: torch.Tensor, kv: LayerKV, ctx: ForwardContext, scale: float, *,
                    out: torch.Tensor | None = None, config: AttnConfig | None = None) -> torch.Tensor:
    """Causal attention of the new tokens over their sequences' pages (K/V already written).

    q: [T, heads, head_dim] -> [T, heads, head_dim] in q's dtype (float32 accumulation). `out`
    (optional, [T, heads, head_dim]) receives the result; `config` overrides the plan (tuning).
    """
    T, H, d = q.shape
    _check_head_dim(d)
    kvh = kv.k.shape[2]
    if H % kvh:
        raise ValueError(f"{H} query heads do not group over {kvh} KV heads")
    if q.stride(-1) != 1:
        raise ValueError("q needs a contiguous head_dim")
    out = torch.empty_like(q) if out is None else out
    if T == 0 or ctx.num_seqs == 0:
        return out
    group = H // kvh
    if config is None and _tma_prefill_shape(q, kv, ctx):
        if _gather_fits(q, kv, ctx):
            from engine.kernels.attention.prefill_tma import prefill_attention
            k, v, cu_seqlens_k = gather_kv(kv.k, kv.v, ctx.block_tables, list(ctx.host_seq_lens),
                                           scales_k=kv.k_scale, scales_v=kv.v_scale, dtype=q.dtype,
                                           plan=ctx.gather_plan(kv.k.shape[1]))
            # the queries' offsets are the context's own query_start_loc (int32 [B + 1], on the device)
            return prefill_attention(q, k, v, ctx.query_start_loc, cu_seqlens_k, ctx.max_query_len, scale, out=out)
        segment_keys = _segment_keys(q, kv, ctx)
        if segment_keys:
            from engine.kernels.attention.prefill_tma import prefill_segments
            return prefill_segments(q, kv, ctx, scale, segment_keys, out=out)
    cfg = plan(q, kv, ctx) if config is None else config
    block_q = cfg.block_m // group
    if block_q < 1:
        raise ValueError(f"block_m {cfg.block_m} is smaller than the group {group}")
    tiles_per_seq, num_tiles = _num_tiles(T, ctx, block_q)
    split = cfg.num_splits > 1
    merge = split and cfg.fused_merge and num_tiles * kvh <= MERGE_COUNTERS
    merge_rows, merge_block = 16, 4             # the kernel's defaults where there is no fused merge (one variant)
    if merge:
        merge_rows = cfg.block_m
        if ctx.uniform_query_len is not None:
            merge_rows = min(merge_rows, max(2, triton.next_power_of_2(ctx.uniform_query_len * group)))
        merge_block = max(1, min(triton.next_power_of_2(cfg.num_splits), MERGE_TILE_FLOATS // (merge_rows * d)))
    if split:
        pacc = torch.empty((T, H, cfg.num_splits, d), dtype=torch.float32, device=q.device)
        pm = torch.empty((T, H, cfg.num_splits), dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
    else:
        pacc = pm = pl = out                        # placeholders, never touched
    kp, vp, ks, vs, *strides = page_args(kv)
    counters = merge_counters(q.device) if merge else pm
    _attn_kernel[(kvh, num_tiles, cfg.num_splits)](
        q, kp, vp, ks, vs, out, pacc, pm, pl, counters, ctx.query_start_loc, ctx.seq_lens, ctx.block_tables,
        scale * LOG2E, ctx.num_seqs, tiles_per_seq, H, cfg.num_splits, cfg.min_tiles,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *strides, ctx.block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=d,
        PAGE=kv.k.shape[1], QUANT=kv.quantized, SPLIT=split, UPCAST=upcast_int8(cfg, kv, q),
        PREFETCH=int(cfg.prefetch), MERGE=merge, MERGE_ROWS=merge_rows, MERGE_SPLITS=merge_block,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.max_regs} if cfg.max_regs and q.is_cuda else {}))
    if split and not merge:
        merge_splits(pacc, pm, pl, out)
    return out


def merge_counters(device: torch.device) -> torch.Tensor:
    """int32 [MERGE_COUNTERS] arrival counters of the fused merge on this device, zeroed once: the merging
    program re-arms its own, so they are zero between launches and a CUDA graph replays right. Made on the
    first call, which the engine's eager warm-up makes before any capture."""
    key = (device.type, device.index)
    if key not in _MERGE_COUNTERS:
        _MERGE_COUNTERS[key] = torch.zeros(MERGE_COUNTERS, dtype=torch.int32, device=device)
    return _MERGE_COUNTERS[key]


def merge_splits(pacc: torch.Tensor, pm: torch.Tensor, pl: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The split-K merge: partial accumulators pacc [T, H, S, d], maxima pm and sums pl [T, H, S] (float32,
    contiguous; an empty split has m = -1e30, l = 0 and never-written pacc rows) -> out [T, H, d]."""
    T, H, splits, d = pacc.shape
    _merge_kernel[(T, H)](pacc, pm, pl, out, H, splits, out.stride(0), out.stride(1),
                          SPLITS_PAD=max(2, triton.next_power_of_2(splits)),
                          SPLIT_BLOCK=max(2, min(triton.next_power_of_2(splits), 4096 // d)), HEAD_DIM=d,
                          num_warps=4 if splits * d >= 4096 else 2)
    return out


# Prefill takes the TMA kernel of prefill_tma.py on gathered K/V: 1.2-1.7x this file's kernel on the H200
# (qwen3-8b, chunk 4096 at context 0 / 8k / 28k, chunk 1024 after 28k; prefill-attn.log in
# bench/results/2026-12-01-h200-decode-variants-prefill-tma/d-6893c60-prefill-tma). The gather is
# a transient copy of every key of the chunk's sequences (int8 pages dequantized into q's dtype by
# engine/kernels/attention/kv_dequant.py), so it is bounded, and it must be paid for by the chunk's attention: a short chunk
# after a long context (a new turn over a cached prefix; fewer than PREFILL_SEGMENT_MIN_QUERIES tokens when it is
# one sequence) reads the pages in place.
PREFILL_GATHER_MIN_QUERIES_PER_KEY = 1 / 32     # the measured win at chunk 1024 after 28k keys is 1 / 29
# One sequence that the rule above turns away (past the gather bound, or too few queries per key) takes the kernel
# segment by segment (prefill_segments; one segment when its keys fit one gather) from this many new tokens: the
# gather costs a fixed amount per key and the attention it speeds up grows with the queries, so the break-even is a
# query count, whatever the context. 1,024 is the measured win at chunk 1024 after 28k keys
# (bench/results/2026-12-01-h200-decode-variants-prefill-tma/d-6893c60-prefill-tma). Chunks of several sequences keep the per-key rule.
PREFILL_SEGMENT_MIN_QUERIES = 1024
# Segments are whole multiples of this (the kernel's key tiles, the page size) and at least SEGMENT_MIN_KEYS.
SEGMENT_ALIGN, SEGMENT_MIN_KEYS = 256, 4096
# int8 pages join both routes through the one-pass dequantizing gather (kv_dequant.py): int8 prefill attention at 32k
# 10.71 -> 4.55 ms a qwen3-8b layer (bench/results/2026-12-02-h200-long-prefill-seed/a-42f2ef9-long-prefill).
# NINFER_PREFILL_TMA_INT8=0 keeps them on this file's kernel.
PREFILL_TMA_INT8 = envs.PREFILL_TMA_INT8.read()


def _tma_prefill_shape(q: torch.Tensor, kv: LayerKV, ctx: ForwardContext) -> bool:
    """What both TMA prefill routes need: a prefill shape (more rows than the decode plan takes) on an sm90 GPU,
    outside any CUDA-graph capture, with host lengths in the context; bf16/fp16 q, pages of its dtype or int8
    (with bf16 q); head_dim in PREFILL_TMA_HEAD_DIMS; q laid out as TMA needs it. `NINFER_PREFILL_TMA=0` turns
    both off."""
    if not q.is_cuda or ctx.host_seq_lens is None or ctx.host_query_lens is None:
        return False
    T, H, d = q.shape
    kvh = kv.k.shape[2]
    q_len = ctx.uniform_query_len if ctx.uniform_query_len is not None else ctx.max_query_len
    if q_len * (H // kvh) <= DECODE_MAX_ROWS or d not in PREFILL_TMA_HEAD_DIMS:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if kv.k.dtype != q.dtype and not (kv.quantized and q.dtype == torch.bfloat16 and PREFILL_TMA_INT8):
        return False
    if q.stride(2) != 1 or q.stride(1) != d or (q.stride(0) * q.element_size()) % 16 or q.data_ptr() % 16:
        return False
    if not envs.PREFILL_TMA.read() or paths_for(q.device).attention_prefill != "triton-tma-prefill":
        return False
    return not torch.cuda.is_current_stream_capturing()      # host lengths and descriptors must not be baked in


def takes_tma_prefill(q: torch.Tensor, kv: LayerKV, ctx: ForwardContext) -> bool:
    """Whether a call gathers all its sequences' keys at once and takes the TMA prefill kernel: the shape rules
    of `_tma_prefill_shape`, the gathered 16-bit K/V within PREFILL_GATHER_MAX_BYTES and at least
    PREFILL_GATHER_MIN_QUERIES_PER_KEY new tokens per key."""
    return _tma_prefill_shape(q, kv, ctx) and _gather_fits(q, kv, ctx)


def _gather_fits(q: torch.Tensor, kv: LayerKV, ctx: ForwardContext) -> bool:
    keys = sum(ctx.host_seq_lens)
    return (2 * keys * kv.k.shape[2] * q.shape[2] * q.element_size() <= PREFILL_GATHER_MAX_BYTES
            and sum(ctx.host_query_lens) >= keys * PREFILL_GATHER_MIN_QUERIES_PER_KEY)


def prefill_segment_keys(q: torch.Tensor, kv: LayerKV, ctx: ForwardContext) -> int:
    """Keys per segment when a call takes the TMA kernel segment by segment (0: it does not): one sequence with
    at least PREFILL_SEGMENT_MIN_QUERIES new tokens. A segment's gathered K/V and the carried float32 state
    together stay within 1.5 x PREFILL_GATHER_MAX_BYTES, what the memory plan holds for a gather
    (engine/worker/memory_plan.py); the last segment holds up to segment_keys + the new tokens."""
    return _segment_keys(q, kv, ctx) if _tma_prefill_shape(q, kv, ctx) else 0


def _segment_keys(q: torch.Tensor, kv: LayerKV, ctx: ForwardContext) -> int:
    T, H, d = q.shape
    if ctx.num_seqs != 1 or T < PREFILL_SEGMENT_MIN_QUERIES:
        return 0
    per_key = 2 * kv.k.shape[2] * d * q.element_size()
    state = T * H * (d + 2) * 4
    keys = (PREFILL_GATHER_MAX_BYTES * 3 // 2 - state) // per_key - T
    keys = keys // SEGMENT_ALIGN * SEGMENT_ALIGN
    return keys if keys >= SEGMENT_MIN_KEYS and keys % kv.k.shape[1] == 0 else 0


def upcast_int8(cfg: AttnConfig, kv: LayerKV, q: torch.Tensor) -> bool:
    """Whether this call takes the in-register int8 conversion: asked for, int8 pages, bf16 q (the
    PTX makes bf16), and compiled (the interpreter runs no PTX; it takes the float32 route, same values)."""
    return (cfg.int8_upcast and kv.quantized and q.dtype == torch.bfloat16
            and type(_attn_kernel).__name__ != "InterpretedFunction")


def attention_bytes(kv: LayerKV, seq_lens: list[int], query_lens: list[int], heads: int, q_itemsize: int) -> int:
    """The fewest bytes one call must move: each sequence's K/V (and scales) once, q read, out written."""
    kvh, d = kv.k.shape[2], kv.k.shape[3]
    per_token = 2 * kvh * (d * kv.k.element_size() + (4 if kv.quantized else 0))
    return sum(seq_lens) * per_token + 2 * sum(query_lens) * heads * d * q_itemsize


def attention_flops(seq_lens: list[int], query_lens: list[int], heads: int, head_dim: int) -> int:
    """Useful FLOPs (q·k and p·v, causal): 4 * heads * head_dim per visible (query, key) pair."""
    pairs = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(query_lens, seq_lens))
    return 4 * heads * head_dim * pairs

