"""The building blocks of the paged decode/prefill attention kernel `_attn_kernel` (paged.py): the in-register
int8 conversion, one step of the online softmax, one masked or unmasked key tile read through the block table,
and a split's partial state with the fused merge its last arrival runs. Triton inlines them into the kernel."""

from __future__ import annotations

import triton
import triton.language as tl

# int8 -> bf16, four at a time (pack=4: byte j of $2 is element j; $0 holds elements 0, 1 as bf16x2,
# $1 elements 2, 3): the bit trick of Triton's own lowering. prmt puts byte b under 0x43, giving
# the bf16 128 + (b & 0x7f) or, with b's sign bit landing in the exponent, 256 + 2 * (b & 0x7f); the
# value is (that & 0xff7f) - (that & 0xff80), computed as one exact bf16x2 fma. 2 PRMT, 4 LOP3 and
# 2 HFMA2 per 4 values, no I2F; sm_80 and later. tests/engine/kernels/attention/test_int8_upcast.py emulates it for
# all 256 bytes.
S8_TO_BF16_PTX = tl.constexpr("""{
    .reg .b32 lo, hi, lo_m, hi_m, lo_s, hi_s, neg1;
    mov.b32 neg1, 0xbf80bf80;
    prmt.b32 lo, $2, 0x43, 0x4140;
    prmt.b32 hi, $2, 0x43, 0x4342;
    and.b32 lo_m, lo, 0xff7fff7f;
    and.b32 hi_m, hi, 0xff7fff7f;
    and.b32 lo_s, lo, 0xff80ff80;
    and.b32 hi_s, hi, 0xff80ff80;
    fma.rn.bf16x2 $0, lo_s, neg1, lo_m;
    fma.rn.bf16x2 $1, hi_s, neg1, hi_m;
}""")


@triton.jit
def _int8_operand(x, UPCAST: tl.constexpr):
    """An int8 K or V tile on its way to a bf16 MMA.

    UPCAST: converted here, in the registers it was loaded into, by S8_TO_BF16_PTX marked impure.
    The opaque op is the point. Triton sizes the MMA operand layout of a dot from the narrowest
    load it can trace either operand back to through elementwise ops; a traced int8 load gives
    8-bit operand layouts (kWidth 4) to *both* operands, so q and p lose ldmatrix and V, key-major
    in shared memory, is read one byte at a time (64 LDS.U8 per thread per 64-key tile, sm_90).
    Behind the asm the dot sees bf16 operands and stages them as for bf16 pages (ldmatrix and
    ldmatrix.trans). Same values either way: the conversion is exact.
    Not UPCAST (the interpreter, q not bf16, prefill plans): int8 -> float32 as before; the dot's
    cast to q's dtype finishes it."""
    if UPCAST:
        return tl.inline_asm_elementwise(asm=S8_TO_BF16_PTX, constraints="=r,=r,r", args=[x],
                                         dtype=tl.bfloat16, is_pure=False, pack=4)
    else:
        return x.to(tl.float32)


@triton.jit
def _query_tile(q_ptr, q_start, q_len, seq_len, tile, kvh, stride_qt, stride_qh, GROUP: tl.constexpr,
                BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A program's rows: up to BLOCK_Q new tokens of one sequence times the GROUP query heads of KV head kvh,
    packed into BLOCK_M rows -> (q [BLOCK_M, HEAD_DIM], query head, row valid, position, token row) per row."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = tile * BLOCK_Q + offs_m // GROUP                  # row -> query index within the sequence
    head = kvh * GROUP + offs_m % GROUP                      # row -> query head
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = seq_len - q_len + tok
    q_row = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    return q, head, row_ok, q_pos, q_row


@triton.jit
def _split_range(seq_len, kv_end, first_pos, split, num_splits, min_units, UNIT: tl.constexpr):
    """One split's keys [lo, hi) of a sequence dealt out in UNIT-key steps, at least min_units steps a split and
    none past kv_end; mid: where its masked steps start (keys < first_pos + 1 are visible to every row of the
    tile); per: keys a split (the merge counts the splits that hold keys by it)."""
    n = (seq_len + UNIT - 1) // UNIT
    per = tl.maximum((n + num_splits - 1) // num_splits, min_units) * UNIT
    lo = split * per
    hi = tl.minimum(lo + per, kv_end)
    return lo, hi, _unmasked_end(lo, hi, first_pos, UNIT), per


@triton.jit
def _unmasked_end(lo, hi, first_pos, UNIT: tl.constexpr):
    # whole UNIT-key steps from lo that every row sees (keys <= first_pos)
    return lo + tl.maximum(tl.minimum(hi, first_pos + 1) - lo, 0) // UNIT * UNIT


@triton.jit
def _scale_scores(s, ks_ptr, vs_ptr, srow, kmask, qk_scale, QUANT: tl.constexpr, MASKED: tl.constexpr):
    """q·k products s [BLOCK_M, BLOCK_N] -> scores in the log2 domain, and V's per-key scales [BLOCK_N] (int8 pages:
    K's scale multiplies each score column, V's is folded into p later; srow: the keys' scale offsets)."""
    if QUANT:
        if MASKED:
            ks = tl.load(ks_ptr + srow, mask=kmask, other=0.0)
            vs = tl.load(vs_ptr + srow, mask=kmask, other=0.0)
        else:
            ks = tl.load(ks_ptr + srow)
            vs = tl.load(vs_ptr + srow)
        s = s * (ks * qk_scale)[None, :]
    else:
        s = s * qk_scale
        vs = qk_scale                                             # a placeholder, never read
    return s, vs


@triton.jit
def _online_softmax(s, m_i, l_i):
    """Scores s [BLOCK_M, BLOCK_N] (log2 domain, scaled) into the running max and sum: -> (p, alpha, l, m)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _accumulate_pv(acc, alpha, p, v, vs, q, QUANT: tl.constexpr, UPCAST: tl.constexpr):
    """acc * alpha + p @ v, V's int8 scale (vs [BLOCK_N]) folded into p's columns."""
    if QUANT:
        p = p * vs[None, :]
        v = _int8_operand(v, UPCAST)
    acc = acc * alpha[:, None]
    return tl.dot(p.to(q.dtype), v.to(q.dtype), acc)


@triton.jit
def _attend_tile(acc, l_i, m_i, q, start, hi, q_pos, table_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
                 head_off, shead_off, stride_pb, stride_pt, stride_sb, stride_st, qk_scale,
                 offs_n, offs_d, PAGE: tl.constexpr, QUANT: tl.constexpr, MASKED: tl.constexpr,
                 UPCAST: tl.constexpr):
    """One BLOCK_N-key step of the online softmax (log2 domain). Unmasked steps load whole tiles
    that every row sees; masked steps also drop keys >= hi and keys after each row's position."""
    keys = start + offs_n                                        # [BLOCK_N] positions
    kmask = keys < hi                                            # read only where MASKED
    if MASKED:
        blk = tl.load(table_ptr + keys // PAGE, mask=kmask, other=0).to(tl.int64)
    else:
        blk = tl.load(table_ptr + keys // PAGE).to(tl.int64)
    row = blk * stride_pb + (keys % PAGE) * stride_pt + head_off  # [BLOCK_N] element offsets
    if MASKED:
        k = tl.load(k_ptr + row[None, :] + offs_d[:, None], mask=kmask[None, :], other=0.0)   # [D, BLOCK_N]
    else:
        k = tl.load(k_ptr + row[None, :] + offs_d[:, None])
    if QUANT:
        k = _int8_operand(k, UPCAST)                              # int8 -> (float32 ->) q's dtype, exact
    s = tl.dot(q, k.to(q.dtype))                                  # [BLOCK_M, BLOCK_N] float32
    srow = blk * stride_sb + (keys % PAGE) * stride_st + shead_off
    s, vs = _scale_scores(s, ks_ptr, vs_ptr, srow, kmask, qk_scale, QUANT, MASKED)
    if MASKED:
        visible = (keys[None, :] <= q_pos[:, None]) & kmask[None, :]
        s = tl.where(visible, s, float("-inf"))
    p, alpha, l_i, m_new = _online_softmax(s, m_i, l_i)
    if MASKED:
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=kmask[:, None], other=0.0)   # [BLOCK_N, D]
    else:
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :])
    return _accumulate_pv(acc, alpha, p, v, vs, q, QUANT, UPCAST), l_i, m_new


@triton.jit
def _store_split(acc, l_i, m_i, pacc_ptr, pm_ptr, pl_ptr, cnt_ptr, o_ptr, q_start, q_len, q_row, head, row_ok,
                 tile, pid, kvh, split, lo, hi, kv_end, per, num_heads, num_splits, stride_ot, stride_oh,
                 GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr, MERGE: tl.constexpr,
                 MERGE_ROWS: tl.constexpr, MERGE_SPLITS: tl.constexpr):
    """The partial state of one split's key range [lo, hi): unnormalised acc [BLOCK_M, HEAD_DIM], running max
    m_i (log2 units) and sum l_i [BLOCK_M], stored at rows [T, H, S]; MERGE: the last split of the (tile, KV
    head) to arrive merges them all (_merge_tile) and re-arms its counter."""
    offs_d = tl.arange(0, HEAD_DIM)
    r = (q_row * num_heads + head) * num_splits + split  # [BLOCK_M] rows of [T, H, S]
    if MERGE:
        stored = row_ok & (hi > lo)      # the fused merge reads only the splits that hold keys (lo < kv_end)
    else:
        stored = row_ok                  # _merge_kernel reads every split's m and l
    tl.store(pm_ptr + r, m_i, mask=stored)
    tl.store(pl_ptr + r, l_i, mask=stored)
    tl.store(pacc_ptr + r[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None] & (hi > lo))
    if MERGE:
        # every thread's partial is stored before the one arrival; acq_rel orders them against the last
        # program's reads of the others' partials (which go around L1: .cg)
        tl.debug_barrier()
        counter = cnt_ptr + pid * tl.num_programs(0) + kvh
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            _merge_tile(pacc_ptr, pm_ptr, pl_ptr, o_ptr, q_start, q_len, tile, kvh, kv_end, per, num_heads,
                        num_splits, stride_ot, stride_oh, GROUP, BLOCK_Q, HEAD_DIM, MERGE_ROWS, MERGE_SPLITS)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_tile(pacc_ptr, pm_ptr, pl_ptr, o_ptr, q_start, q_len, tile, kvh, kv_end, per, num_heads, num_splits,
                stride_ot, stride_oh, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
                MERGE_ROWS: tl.constexpr, MERGE_SPLITS: tl.constexpr):
    """The split-K merge of one tile's rows, run by the last of its splits to finish: out = sum_s 2^(m_s - M)
    acc_s / sum_s 2^(m_s - M) l_s over the splits that hold keys (the first ceil(kv_end / per)), MERGE_SPLITS
    of them per memory trip with a running maximum. MERGE_ROWS (a power of two) covers the tile's rows that
    exist: query_len * GROUP in a uniform decode or verify batch, else BLOCK_M."""
    offs_r = tl.arange(0, MERGE_ROWS)
    offs_s = tl.arange(0, MERGE_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = tile * BLOCK_Q + offs_r // GROUP
    head = kvh * GROUP + offs_r % GROUP
    ok = (offs_r < BLOCK_Q * GROUP) & (tok < q_len)
    q_row = (q_start + tok).to(tl.int64)
    base = (q_row * num_heads + head) * num_splits                            # [R] split 0 of each row
    active = (kv_end + per - 1) // per
    top = tl.full([MERGE_ROWS], -1.0e30, tl.float32)
    denom = tl.zeros([MERGE_ROWS], tl.float32)
    out = tl.zeros([MERGE_ROWS, HEAD_DIM], tl.float32)
    for s0 in range(0, active, MERGE_SPLITS):
        sok = ok[:, None] & (s0 + offs_s < active)[None, :]                    # [R, S]
        idx = base[:, None] + s0 + offs_s[None, :]
        m = tl.load(pm_ptr + idx, mask=sok, other=-1.0e30, cache_modifier=".cg")
        l = tl.load(pl_ptr + idx, mask=sok, other=0.0, cache_modifier=".cg")
        a = tl.load(pacc_ptr + idx[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=sok[:, :, None],
                    other=0.0, cache_modifier=".cg")                            # [R, S, D]
        # a row that sees no key of a split (l = 0) may hold anything there: a select drops it
        a = tl.where((l > 0)[:, :, None], a, 0.0)
        new_top = tl.maximum(top, tl.max(m, 1))
        alpha = tl.exp2(top - new_top)
        w = tl.exp2(m - new_top[:, None])
        denom = denom * alpha + tl.sum(w * l, 1)
        out = out * alpha[:, None] + tl.sum(a * w[:, :, None], 1)
        top = new_top
    out = out / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(o_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=ok[:, None])
