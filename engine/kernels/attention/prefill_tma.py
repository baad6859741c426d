"""Prefill attention over contiguous K/V: a Triton FlashAttention forward with TMA tile loads.

Why a second attention kernel. `_attn_kernel` (engine/kernels/attention/paged.py) reads K/V straight
from the paged cache: each key row needs its block-table entry, so every K/V tile is a gather of
BLOCK_N 256-byte rows by `cp.async` (LDGSTS), issued and waited for by the same warps that run the
MMAs. On the H200 that route stays at 0.42-0.48 of the bf16 matmul rate for long prefill chunks
(bench/results/2026-11-30-h200/kernels-run1.json). For a prefill chunk the gather is cheap to do once instead: all of a
chunk's keys are copied into one contiguous buffer per layer (`gather_kv`: 2 x kv_heads x head_dim
x 2 bytes per key, ~4 KB per key for K and V together at qwen3-8b, about 1% of the attention's
time at 28k context), and the attention itself then reads rectangular tiles that the Hopper TMA
unit fetches with one instruction each (`cp.async.bulk.tensor`), with no address arithmetic in the
warps and no per-row block-table loads.

Layout (FlashAttention's varlen convention, "packed"):
  q   [total_q, heads, head_dim]       the new tokens of B sequences, one after another
  k,v [total_k, kv_heads, head_dim]    each sequence's keys, positions 0 .. k_len-1, one after another
  cu_seqlens_q, cu_seqlens_k [B + 1]   int32 prefix sums (sequence b: rows cu[b] .. cu[b+1])
  out [total_q, heads, head_dim]
Query i of sequence b (q_len = its query count, k_len = its key count) sits at position
k_len - q_len + i and sees keys 0 .. k_len - q_len + i (causal, aligned to the bottom right: a chunk
after earlier context). head_dim is contiguous everywhere; q/out may have any token stride.

The program: one per (query head, sequence, BLOCK_M-query tile). Grid (heads, B, max tiles), heads
fastest, so the GROUP query heads that share a KV head run side by side and read each K/V tile from
L2 right after the first of them brought it in (how FlashAttention-3 handles GQA). Tiles are issued
longest first (the last query tile of a causal chunk sees the most keys). The loop over keys is
FlashAttention-2's online softmax in the log2 domain with the 1/sqrt(d)·log2(e) scale folded into
one FMA per score (`qk * scale - m`), in two parts:
  1. key tiles every row of the query tile sees whole: no mask at all;
  2. the tiles that straddle the causal diagonal: masked by position (for the rows of the
     sequence that also drops keys past its end; rows past q_len are never stored).
Tiles past the tile's last query are never loaded. Float32 softmax state and accumulator, output
in q's dtype.

Hopper features and why:
- TMA (tensor descriptors): Q, K, V tiles (and O, for tiles that lie wholly inside their
  sequence) move by `cp.async.bulk.tensor`, with completion on an mbarrier, straight into the
  swizzled shared-memory layout that `wgmma` reads: no register staging, no LDGSTS issue slots.
  Host-side descriptors (`triton.tools.tensor_descriptor.TensorDescriptor`), built once per call
  and passed as kernel parameters: no device-side descriptor writes and no global scratch.
  Tiles that run past a sequence's keys read the next sequence's rows (or TMA's zero fill past
  the tensor's end); the mask of loop 2 drops them. The last query tile of a sequence, which may
  reach into the next sequence's rows, stores with a masked `tl.store` instead of TMA.
- `wgmma` for both products (q·k with q and k from shared memory, p·v with p from registers).
- `tl.range(..., num_stages=S)`: the unmasked loop, which is nearly all of the work at long
  contexts, is software-pipelined S deep (S K/V buffers, loads of the next steps in flight).
- Softmax beside the MMAs: Triton 3.6 gives that overlap between programs, not inside one.
  Configurations with two resident programs per SM (`bm64 bn64 w4 s2`: 146 registers, 81 KB;
  `bm128 bn64 w8 s2` capped at 128 registers: 96 KB) let one program's exp2/max/sum run while the
  other's MMAs do, with no schedule enforced. tools/dev/prefill_attention_check.py sweeps these against
  the one-per-SM 128 x 128 tiles.
Tried and dropped, measured on the H200 at chunk 4096
(bench/results/2026-12-01-h200-decode-variants-prefill-tma/d-6893c60-prefill-tma/prefill-attn.log): Triton's warp
specialization of the key loop compiles to the same PTX as without (Triton 3.6, sm_90). FA3's
intra-warpgroup overlap (the next tile's q·k issued before this tile's softmax) was slower, 4.84
against 4.75 ms after 28k keys and 0.365 against 0.350 ms at context 0, as Triton waits on that
wgmma at once. Packing a KV head's GQA group into a program's rows (vLLM's layout, 3-D q/out boxes)
took 4.29-4.73 ms after 28k, against 3.94 ms for the default `bm128 bn64 w8 s2 maxnreg 128`.

Past the gather bound (engine.worker.paged_kv.PREFILL_GATHER_MAX_BYTES, 64k keys of qwen3-8b K/V), one sequence's
keys go through the kernel in segments (`prefill_segments`): each segment is gathered and attended in its own
launch, and the float32 softmax state (acc, m, l) is stored after a launch and loaded by the next (CARRY_OUT,
CARRY_IN), so one accumulator sees every key and only the last launch normalizes. The segments before the chunk
are seen whole by every query (`pos_shift` moves the rows' positions past them), so they run the unmasked loop
only. H200, one layer, chunk 4096 (bench/results/2026-12-02-h200-long-prefill-seed/a): 500-520 TFLOP/s from 65k to 196k keys
against the paged kernel's 350 (bf16 pages) and 216 (int8 pages, dequantized by the gather).

The interpreter (TRITON_INTERPRET=1) runs the same kernel on the CPU, descriptors included
(tests/engine/kernels/attention/test_prefill_tma.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.worker.paged_kv import gather_kv

try:                                            # Triton >= 3.4: host-side TMA descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:                             # pragma: no cover - older Triton
    TensorDescriptor = None

LOG2E = 1.4426950408889634


@triton.jit
def _attend(acc, l_i, m_i, q, desc_k, desc_v, k_row0, kv_col, lo, hi, q_pos, qk_scale,
            BLOCK_N: tl.constexpr, MASKED: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Keys [lo, hi) of one sequence (lo a multiple of BLOCK_N), BLOCK_N at a time, online softmax in
    log2 units. MASKED: drop keys after each row's position q_pos [BLOCK_M]."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        start = tl.multiple_of(start, BLOCK_N)
        k = desc_k.load([k_row0 + start, kv_col])                  # [BLOCK_N, D]
        s = tl.dot(q, k.T)                                          # [BLOCK_M, BLOCK_N] float32, unscaled
        if MASKED:
            # keys after each row's position: for the rows of the sequence (q_pos < k_len) this also
            # drops every key past the sequence's end; rows past q_len are never stored
            keys = start + offs_n
            visible = keys[None, :] <= q_pos[:, None]
            s = tl.where(visible, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
        else:
            # scale folded into the subtraction: one FMA per score
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = desc_v.load([k_row0 + start, kv_col])                  # [BLOCK_N, D]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _store_rows(out, o_ptr, q_start, m0, q_len, head, stride_ot, stride_oh, BLOCK_M: tl.constexpr,
                HEAD_DIM: tl.constexpr):
    # the rows with query < q_len only: the sequence's last tile may reach into the next sequence's
    # rows, which a TMA store would overwrite
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = m0 + offs_m
    ptrs = o_ptr + head * stride_oh + (q_start + tok).to(tl.int64)[:, None] * stride_ot + offs_d[None, :]
    tl.store(ptrs, out, mask=(tok < q_len)[:, None])


@triton.jit
def _state_offsets(q_start, m0, q_len, head, num_heads, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    # the float32 state of prefill_segments: acc [T, heads, D], m and l [T, heads] (contiguous)
    tok = m0 + tl.arange(0, BLOCK_M)
    row = (q_start + tok).to(tl.int64) * num_heads + head              # [BLOCK_M]
    return row, row[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :], tok < q_len


@triton.jit
def _load_state(acc_ptr, m_ptr, l_ptr, q_start, m0, q_len, head, num_heads, BLOCK_M: tl.constexpr,
                HEAD_DIM: tl.constexpr):
    row, cell, valid = _state_offsets(q_start, m0, q_len, head, num_heads, BLOCK_M, HEAD_DIM)
    acc = tl.load(acc_ptr + cell, mask=valid[:, None], other=0.0)
    m_i = tl.load(m_ptr + row, mask=valid, other=-1.0e30)
    l_i = tl.load(l_ptr + row, mask=valid, other=0.0)
    return acc, m_i, l_i


@triton.jit
def _store_state(acc, m_i, l_i, acc_ptr, m_ptr, l_ptr, q_start, m0, q_len, head, num_heads, BLOCK_M: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
    row, cell, valid = _state_offsets(q_start, m0, q_len, head, num_heads, BLOCK_M, HEAD_DIM)
    tl.store(acc_ptr + cell, acc, mask=valid[:, None])
    tl.store(m_ptr + row, m_i, mask=valid)
    tl.store(l_ptr + row, l_i, mask=valid)


@triton.jit
def _prefill_attn_kernel(desc_q, desc_k, desc_v, desc_o, o_ptr, cu_q_ptr, cu_k_ptr, qk_scale, stride_ot, stride_oh,
                         acc_ptr, m_ptr, l_ptr, num_heads, pos_shift,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         NUM_STAGES: tl.constexpr, TMA_STORE: tl.constexpr,
                         CARRY_IN: tl.constexpr, CARRY_OUT: tl.constexpr):
    # grid (heads, sequences, max query tiles), heads fastest: the GQA siblings of one tile run side
    # by side and share K/V tiles in L2
    head = tl.program_id(0)
    seq = tl.program_id(1)
    t = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    n_tiles = tl.cdiv(q_len, BLOCK_M)
    if t >= n_tiles:
        return
    tile = n_tiles - 1 - t                                  # longest (latest) tiles first
    k_start = tl.load(cu_k_ptr + seq)
    k_len = tl.load(cu_k_ptr + seq + 1) - k_start
    m0 = tile * BLOCK_M                                     # the tile's first query within the sequence
    # its position relative to the first key given; pos_shift > 0 for a segment that ends before the
    # sequence does (prefill_segments: every query sees all of its keys)
    first_pos = k_len - q_len + m0 + pos_shift
    q_pos = first_pos + tl.arange(0, BLOCK_M)               # [BLOCK_M]; rows past q_len: dropped at the store

    q = desc_q.load([q_start + m0, head * HEAD_DIM])        # [BLOCK_M, D]
    kv_col = (head // GROUP) * HEAD_DIM
    if CARRY_IN:                                            # the softmax state after the earlier segments
        acc, m_i, l_i = _load_state(acc_ptr, m_ptr, l_ptr, q_start, m0, q_len, head, num_heads, BLOCK_M, HEAD_DIM)
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)       # finite: no inf - inf on a fully masked tile
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # keys <= first_pos are visible to every row of the tile: whole tiles below need no mask (a segment
    # before the queries, a multiple of BLOCK_N keys, is all such tiles)
    mid = tl.minimum((first_pos + 1) // BLOCK_N * BLOCK_N, k_len)
    hi = tl.minimum(k_len, first_pos + BLOCK_M)              # keys after the tile's last query: never seen
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, desc_k, desc_v, k_start, kv_col, 0, mid, q_pos, qk_scale,
                            BLOCK_N, False, NUM_STAGES)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, desc_k, desc_v, k_start, kv_col, mid, hi, q_pos, qk_scale,
                            BLOCK_N, True, NUM_STAGES)

    if CARRY_OUT:
        _store_state(acc, m_i, l_i, acc_ptr, m_ptr, l_ptr, q_start, m0, q_len, head, num_heads, BLOCK_M, HEAD_DIM)
        return
    out = (acc / l_i[:, None]).to(o_ptr.dtype.element_ty)
    if TMA_STORE:
        if m0 + BLOCK_M <= q_len:
            desc_o.store([q_start + m0, head * HEAD_DIM], out)
        else:
            _store_rows(out, o_ptr, q_start, m0, q_len, head, stride_ot, stride_oh, BLOCK_M, HEAD_DIM)
    else:
        _store_rows(out, o_ptr, q_start, m0, q_len, head, stride_ot, stride_oh, BLOCK_M, HEAD_DIM)


@dataclass(frozen=True)
class PrefillConfig:
    """Launch shape. BLOCK_N <= BLOCK_M keeps the diagonal to at most BLOCK_M / BLOCK_N + 1 masked tiles."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2
    tma_store: bool = True
    # a register cap (ptxas): 128 lets two 8-warp programs share an SM (bm128 bn64 s2: 96 KB shared
    # each, no spills in ptxas for sm_90), so one program's softmax can run beside the other's MMAs
    maxnreg: int | None = None


# head_dim 128: 128 x 64 tiles, 8 warps, capped at 128 registers so that two programs share an SM --
# the fastest row of tools/dev/prefill_attention_check.py on the H200 after 28k keys (3.94 ms, 524 TFLOP/s,
# against 4.75 for 128 x 128 at one per SM) and within 1 % of the fastest at context 0
# (bench/results/2026-12-01-h200-decode-variants-prefill-tma/d-6893c60-prefill-tma/prefill-attn.log).
# head_dim 256: a 128 x 256 float32 accumulator is 128 registers a thread over 8 warps; 64-key tiles
# keep the score tile and the K/V stages inside 227 KB of shared memory.
DEFAULT = {128: PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=2, maxnreg=128),
           256: PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)}


def default_config(head_dim: int) -> PrefillConfig:
    return DEFAULT.get(head_dim, PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=2))


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    """[T, heads, D] with contiguous (heads, D) rows -> a [T, heads * D] view (TMA wants a 2-D matrix
    with unit last stride and 16-byte aligned row stride)."""
    T, n, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d:
        raise ValueError(f"need [T, heads, head_dim] with contiguous heads and head_dim, got strides {x.stride()}")
    if (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
        raise ValueError("TMA needs a 16-byte aligned base and row stride")
    return x.as_strided((T, n * d), (x.stride(0), 1))


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, max_seqlen_q: int, scale: float, *,
                      out: torch.Tensor | None = None, config: PrefillConfig | None = None) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' contiguous keys.

    q: [total_q, heads, D]; k, v: [total_k, kv_heads, D] (bf16/fp16, D a power of two >= 16);
    cu_seqlens_q, cu_seqlens_k: [B + 1] int32 on q's device; every sequence needs q_len <= k_len
    (query i at position k_len - q_len + i). max_seqlen_q: a host bound of the query counts (sizes
    the grid; no device read). Returns out [total_q, heads, D] in q's dtype.
    """
    T, H, d = q.shape
    _, kvh, dk = k.shape
    if v.shape != k.shape or dk != d:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")
    if H % kvh:
        raise ValueError(f"{H} query heads do not group over {kvh} KV heads")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError("q, k, v must share one 16-bit float dtype")
    if TensorDescriptor is None:
        raise RuntimeError("this Triton has no triton.tools.tensor_descriptor (needs >= 3.4)")
    out = torch.empty_like(q) if out is None else out
    B = cu_seqlens_q.shape[0] - 1
    if T == 0 or B == 0 or max_seqlen_q == 0:
        return out
    _launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, out, default_config(d) if config is None
            else config)
    return out


def _launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, scale: float, out, cfg: PrefillConfig, *,
            state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, pos_shift: int = 0,
            carry_in: bool = False, carry_out: bool = False) -> None:
    T, H, d = q.shape
    bm, bn = cfg.block_m, cfg.block_n
    desc_k = TensorDescriptor.from_tensor(_as_2d(k), [bn, d])
    desc_v = TensorDescriptor.from_tensor(_as_2d(v), [bn, d])
    desc_q = TensorDescriptor.from_tensor(_as_2d(q), [bm, d])
    desc_o = TensorDescriptor.from_tensor(_as_2d(out), [bm, d])
    acc, m, l = state if state is not None else (out, out, out)         # placeholders, never touched
    grid = (H, cu_seqlens_q.shape[0] - 1, triton.cdiv(max_seqlen_q, bm))
    _prefill_attn_kernel[grid](
        desc_q, desc_k, desc_v, desc_o, out, cu_seqlens_q, cu_seqlens_k, scale * LOG2E,
        out.stride(0), out.stride(1), acc, m, l, H, pos_shift,
        GROUP=H // k.shape[1], HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, NUM_STAGES=cfg.num_stages,
        TMA_STORE=cfg.tma_store, CARRY_IN=carry_in, CARRY_OUT=carry_out,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))


def prefill_segments(q: torch.Tensor, kv, ctx, scale: float, segment_keys: int, *,
                     out: torch.Tensor | None = None, config: PrefillConfig | None = None) -> torch.Tensor:
    """Causal prefill of one sequence (engine.kernels.attention.paged.prefill_segment_keys: one with enough new tokens,
    usually one whose keys are too many for one gather, engine.worker.paged_kv PREFILL_GATHER_MAX_BYTES): its keys in
    segments of `segment_keys` (a multiple of the page and of BLOCK_N),
    each gathered into contiguous K/V (int8 pages dequantized into q's dtype) and attended by the kernel, which
    carries the float32 softmax state (acc, m, l) from one segment's launch to the next and normalizes after the
    last. Segments before the chunk's first token are seen whole by every query (pos_shift); the last is causal.

    q: [T, heads, D] the sequence's new tokens (ctx: one sequence, host lengths set); kv: its LayerKV.
    Returns out [T, heads, D] in q's dtype."""
    T, H, d = q.shape
    if ctx.num_seqs != 1 or ctx.host_seq_lens is None or ctx.host_query_lens is None:
        raise ValueError("prefill_segments takes one sequence with host lengths")
    cfg = default_config(d) if config is None else config
    if segment_keys % cfg.block_n:
        raise ValueError(f"segment_keys {segment_keys} is not a multiple of block_n {cfg.block_n}")
    out = torch.empty_like(q) if out is None else out
    seg = ctx.segment_plan(kv.k.shape[1], segment_keys)
    k_len = ctx.host_seq_lens[0]
    state = None
    if len(seg.bounds) > 1:
        state = (torch.empty((T, H, d), dtype=torch.float32, device=q.device),
                 torch.empty((T, H), dtype=torch.float32, device=q.device),
                 torch.empty((T, H), dtype=torch.float32, device=q.device))
    for i, ((lo, hi), plan) in enumerate(zip(seg.bounds, seg.gathers)):
        k, v, cu_k = gather_kv(kv.k, kv.v, ctx.block_tables, [hi - lo], scales_k=kv.k_scale, scales_v=kv.v_scale,
                               dtype=q.dtype, plan=plan)
        _launch(q, k, v, ctx.query_start_loc, cu_k, T, scale, out, cfg, state=state, pos_shift=k_len - hi,
                carry_in=i > 0, carry_out=i < len(seg.bounds) - 1)
        del k, v                # before the next gather: one segment's K/V alive at a time (the memory plan's bound)
    return out


def prefill_from_pages(q: torch.Tensor, pages_k: torch.Tensor, pages_v: torch.Tensor, block_tables: torch.Tensor,
                       query_lens: list[int], seq_lens: list[int], scale: float, *,
                       scales_k: torch.Tensor | None = None, scales_v: torch.Tensor | None = None,
                       out: torch.Tensor | None = None, config: PrefillConfig | None = None) -> torch.Tensor:
    """gather_kv + prefill_attention for a prefill batch (host lengths, as the engine's eager prefill
    has them in ctx.host_query_lens / the scheduler). q: [sum(query_lens), heads, D] -> same shape."""
    k, v, cu_k = gather_kv(pages_k, pages_v, block_tables, seq_lens, scales_k=scales_k, scales_v=scales_v,
                           dtype=q.dtype)
    cu_q = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    cu_q[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int64), 0).to(torch.int32)
    return prefill_attention(q, k, v, cu_q.to(q.device, non_blocking=True), cu_k, max(query_lens, default=0),
                             scale, out=out, config=config)
