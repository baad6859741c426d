"""The Triton code of the decode GEMV (launched by engine/kernels/gemv.py, whose docstring says how it works).

One program: BLOCK_N output rows x one slice of K, walked BLOCK_K columns at a time; M (1, 2, 4 or 8,
the rows past the caller's count masked) activation rows accumulated in separate registers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels import pdl

FP8_CODE, NVFP4_CODE, BF16_CODE = 0, 1, 2

# four packed bytes -> the eight values (x 2^-14) in fp32: low nibbles of bytes 0..3, then high nibbles
E2M1_ASM = tl.constexpr("""
{
.reg .b32 a, b, c, d, t, u;
.reg .b16 h<8>;
shl.b32 t, $8, 9;  and.b32 t, t, 0x0E000E00; shl.b32 u, $8, 12; and.b32 u, u, 0x80008000; or.b32 a, t, u;
shl.b32 t, $8, 1;  and.b32 t, t, 0x0E000E00; shl.b32 u, $8, 4;  and.b32 u, u, 0x80008000; or.b32 b, t, u;
shl.b32 t, $8, 5;  and.b32 t, t, 0x0E000E00; shl.b32 u, $8, 8;  and.b32 u, u, 0x80008000; or.b32 c, t, u;
shr.b32 t, $8, 3;  and.b32 t, t, 0x0E000E00; and.b32 u, $8, 0x80008000; or.b32 d, t, u;
mov.b32 {h0, h1}, a; mov.b32 {h2, h3}, b; mov.b32 {h4, h5}, c; mov.b32 {h6, h7}, d;
cvt.f32.f16 $0, h0; cvt.f32.f16 $1, h2; cvt.f32.f16 $2, h1; cvt.f32.f16 $3, h3;
cvt.f32.f16 $4, h4; cvt.f32.f16 $5, h6; cvt.f32.f16 $6, h5; cvt.f32.f16 $7, h7;
}
""")


@triton.jit
def _e2m1_x2p14(c):
    # c: int32 codes 0..15 -> fp32 value * 2^-14 (fp16 bits: sign 15, exponent 10..11, mantissa 9)
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _row_part(w_lo, w_hi, s, x_ptr, row_ok, k0, k_end, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, VEC: tl.constexpr, EVEN_K: tl.constexpr, X2D: tl.constexpr):
    """One activation row's in-thread partial sums over a tile: [BLOCK_N, BLOCK_K // VEC] fp32."""
    offs_x = k0 + tl.arange(0, BLOCK_K)
    if FMT != 1 and X2D:
        # the activation columns loaded in the weight tile's own shape (each thread loads the columns it
        # multiplies, from L1), so no layout conversion through shared memory is needed
        x_ptrs = x_ptr + offs_x[None, :] + tl.zeros((BLOCK_N, 1), dtype=tl.int32)
        if EVEN_K:
            x2 = tl.load(x_ptrs, mask=row_ok, other=0.0).to(tl.float32)
        else:
            x2 = tl.load(x_ptrs, mask=(offs_x[None, :] < k_end) & row_ok, other=0.0).to(tl.float32)
    else:
        if EVEN_K:
            x = tl.load(x_ptr + offs_x, mask=row_ok, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptr + offs_x, mask=(offs_x < k_end) & row_ok, other=0.0).to(tl.float32)
        x2 = x[None, :]
    if FMT == 1:
        # activation columns 2j meet the low nibbles, 2j+1 the high ones
        xe, xo = tl.split(tl.reshape(x, (BLOCK_K // 2, 2)))
        prod = w_lo * xe[None, :] + w_hi * xo[None, :]
        part = tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // 16, 8)), axis=2) * s    # [BN, BK/16] group scales
    else:
        part = tl.sum(tl.reshape(w_lo * x2, (BLOCK_N, BLOCK_K // VEC, VEC)), axis=2)
    return part


@triton.jit
def _load_tile(w_rows, s_ptr, offs_n, n_ok, stride_sn, row_blk, k0, k_end, FMT: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN: tl.constexpr, SCALE_BC: tl.constexpr):
    """The raw weight tile at columns k0.. (packed bytes, fp8 or bf16) and its scales (NVFP4: fp8 [BN, BK/16];
    FP8: fp32 [BK] of the program's scale row; bf16: the tile again, unused)."""
    if FMT == 1:
        offs = k0 // 2 + tl.arange(0, BLOCK_K // 2)                          # bytes
        offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK_K // 2), BLOCK_K // 2)
        offs_g = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        offs_g = tl.max_contiguous(tl.multiple_of(offs_g, BLOCK_K // 16), BLOCK_K // 16)
        s_ptrs = s_ptr + offs_n[:, None].to(tl.int64) * stride_sn + offs_g[None, :]
        if EVEN:
            raw = tl.load(w_rows + offs[None, :])
            s_raw = tl.load(s_ptrs)
        else:
            raw = tl.load(w_rows + offs[None, :], mask=n_ok[:, None] & (offs[None, :] < k_end // 2), other=0)
            s_raw = tl.load(s_ptrs, mask=n_ok[:, None] & (offs_g[None, :] < k_end // 16), other=0.0)
    else:
        offs = k0 + tl.arange(0, BLOCK_K)
        offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK_K), BLOCK_K)
        if EVEN:
            raw = tl.load(w_rows + offs[None, :])
        else:
            raw = tl.load(w_rows + offs[None, :], mask=n_ok[:, None] & (offs[None, :] < k_end), other=0.0)
        if FMT == 0:
            if EVEN:
                s_raw = tl.load(s_ptr + row_blk * stride_sn + offs // SCALE_BC)
            else:
                s_raw = tl.load(s_ptr + row_blk * stride_sn + offs // SCALE_BC, mask=offs < k_end, other=0.0)
        else:
            s_raw = raw
    return raw, s_raw


@triton.jit
def gemv_kernel(x_ptr, w_ptr, s_ptr, rs_ptr, o_ptr, ws_ptr, cnt_ptr, M_rows, N, K, stride_xm, stride_wn, stride_sn,
                 stride_om, k_per_split, scale_br,
                 FMT: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                 SCALE_BC: tl.constexpr, X2D: tl.constexpr, PREFETCH: tl.constexpr, USE_PDL: tl.constexpr = False):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    VEC: tl.constexpr = 16 if FMT == 0 else 8
    COLS: tl.constexpr = BLOCK_K // 16 if FMT == 1 else BLOCK_K // VEC
    acc0 = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
    acc4 = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
    acc5 = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
    acc6 = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
    acc7 = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    row_blk = (pid_n * BLOCK_N) // scale_br
    if PREFETCH:
        raw, s_raw = _load_tile(w_rows, s_ptr, offs_n, n_ok, stride_sn, row_blk, k_start, k_end, FMT, BLOCK_K,
                                EVEN_K and EVEN_N, SCALE_BC)
    # the first weight tile (with PREFETCH) is read before the kernel ahead has finished; the activations,
    # the split-K workspace and the output only after
    pdl.wait_for_inputs(USE_PDL)
    for k0 in range(k_start, k_end, BLOCK_K):
        k0 = tl.multiple_of(k0, BLOCK_K)            # k_per_split is a multiple of BLOCK_K
        if PREFETCH:
            # the next tile's loads go out before this tile's arithmetic: two tiles in flight per program
            if EVEN_K and EVEN_N:
                # unmasked (16-byte loads): the last iteration loads the last tile again, from L2
                k_next = tl.multiple_of(tl.minimum(k0 + BLOCK_K, k_end - BLOCK_K), BLOCK_K)
                raw_next, s_next = _load_tile(w_rows, s_ptr, offs_n, n_ok, stride_sn, row_blk, k_next, k_end, FMT,
                                              BLOCK_K, True, SCALE_BC)
            else:
                raw_next, s_next = _load_tile(w_rows, s_ptr, offs_n, n_ok, stride_sn, row_blk, k0 + BLOCK_K, k_end,
                                              FMT, BLOCK_K, False, SCALE_BC)
        else:
            raw, s_raw = _load_tile(w_rows, s_ptr, offs_n, n_ok, stride_sn, row_blk, k0, k_end, FMT, BLOCK_K,
                                    EVEN_K and EVEN_N, SCALE_BC)
        if FMT == 1:
            if ASM:
                w_lo, w_hi = tl.inline_asm_elementwise(E2M1_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [raw],
                                                       dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
            else:
                pi = raw.to(tl.int32)
                w_lo = _e2m1_x2p14(pi & 15)
                w_hi = _e2m1_x2p14(pi >> 4)
            s = s_raw.to(tl.float32)                                        # [BN, BK/16]
        else:
            w_lo = raw.to(tl.float32)
            if FMT == 0:
                w_lo = w_lo * s_raw[None, :]                                # [BK] block scales of this row block
            w_hi = w_lo
            s = 1.0
        acc0 += _row_part(w_lo, w_hi, s, x_ptr, M_rows > 0, k0, k_end,
                          FMT, BLOCK_N, BLOCK_K, VEC, EVEN_K, X2D)
        if M > 1:
            acc1 += _row_part(w_lo, w_hi, s, x_ptr + stride_xm, M_rows > 1, k0, k_end,
                              FMT, BLOCK_N, BLOCK_K, VEC, EVEN_K, X2D)
        if M > 2:
            acc2 += _row_part(w_lo, w_hi, s, x_ptr + 2 * stride_xm, M_rows > 2, k0, k_end,
                              FMT, BLOCK_N, BLOCK_K, VEC, EVEN_K, X2D)
        if M > 3:
            acc3 += _row_part(w_lo, w_hi, s, x_ptr + 3 * stride_xm, M_rows > 3, k0, k_end,
                              FMT, BLOCK_N, BLOCK_K, VEC, EVEN_K, X2D)
        if M > 4:
            acc4 += _row_part(w_lo, w_hi, s, x_ptr + 4 * stride_xm, M_rows > 4, k0, k_end,
                              FMT, BLOCK_N, BLOCK_K, VEC, EVEN_K, X2D)
        if M > 5:
            acc5 += _row_part(w_lo, w_hi, s, x_ptr + 5 * stride_xm, M_rows > 5, k0, k_end,
                              FMT, BLOCK_N, BLOCK_K, VEC, EVEN_K, X2D)
        if M > 6:
            acc6 += _row_part(w_lo, w_hi, s, x_ptr + 6 * stride_xm, M_rows > 6, k0, k_end,
                              FMT, BLOCK_N, BLOCK_K, VEC, EVEN_K, X2D)
        if M > 7:
            acc7 += _row_part(w_lo, w_hi, s, x_ptr + 7 * stride_xm, M_rows > 7, k0, k_end,
                              FMT, BLOCK_N, BLOCK_K, VEC, EVEN_K, X2D)
        if PREFETCH:
            raw, s_raw = raw_next, s_next
    if FMT == 1:
        rs = tl.load(rs_ptr + offs_n, mask=n_ok, other=0.0) * 16384.0
    else:
        rs = tl.full((BLOCK_N,), 1.0, tl.float32)
    _finish(tl.sum(acc0, axis=1) * rs, 0, o_ptr, ws_ptr, cnt_ptr, offs_n, n_ok, N, stride_om,
            pid_n, pid_k, SPLIT, M, M_rows)
    if M > 1:
        _finish(tl.sum(acc1, axis=1) * rs, 1, o_ptr, ws_ptr, cnt_ptr, offs_n, n_ok, N, stride_om,
                pid_n, pid_k, SPLIT, M, M_rows)
    if M > 2:
        _finish(tl.sum(acc2, axis=1) * rs, 2, o_ptr, ws_ptr, cnt_ptr, offs_n, n_ok, N, stride_om,
                pid_n, pid_k, SPLIT, M, M_rows)
    if M > 3:
        _finish(tl.sum(acc3, axis=1) * rs, 3, o_ptr, ws_ptr, cnt_ptr, offs_n, n_ok, N, stride_om,
                pid_n, pid_k, SPLIT, M, M_rows)
    if M > 4:
        _finish(tl.sum(acc4, axis=1) * rs, 4, o_ptr, ws_ptr, cnt_ptr, offs_n, n_ok, N, stride_om,
                pid_n, pid_k, SPLIT, M, M_rows)
    if M > 5:
        _finish(tl.sum(acc5, axis=1) * rs, 5, o_ptr, ws_ptr, cnt_ptr, offs_n, n_ok, N, stride_om,
                pid_n, pid_k, SPLIT, M, M_rows)
    if M > 6:
        _finish(tl.sum(acc6, axis=1) * rs, 6, o_ptr, ws_ptr, cnt_ptr, offs_n, n_ok, N, stride_om,
                pid_n, pid_k, SPLIT, M, M_rows)
    if M > 7:
        _finish(tl.sum(acc7, axis=1) * rs, 7, o_ptr, ws_ptr, cnt_ptr, offs_n, n_ok, N, stride_om,
                pid_n, pid_k, SPLIT, M, M_rows)
    if SPLIT > 1:
        _reduce_splits(o_ptr, ws_ptr, cnt_ptr, offs_n, n_ok, N, stride_om, pid_n, SPLIT, M, M_rows)


@triton.jit
def _finish(y, m, o_ptr, ws_ptr, cnt_ptr, offs_n, n_ok, N, stride_om, pid_n, pid_k, SPLIT: tl.constexpr,
            M: tl.constexpr, M_rows):
    # y: [BN] fp32 of row m: the output (one split) or this split's partial in the workspace [SPLIT, M, N]
    if SPLIT == 1:
        tl.store(o_ptr + m * stride_om + offs_n, y.to(o_ptr.dtype.element_ty), mask=n_ok & (m < M_rows))
    else:
        tl.store(ws_ptr + (pid_k * M + m).to(tl.int64) * N + offs_n, y, mask=n_ok)


@triton.jit
def _reduce_splits(o_ptr, ws_ptr, cnt_ptr, offs_n, n_ok, N, stride_om, pid_n, SPLIT: tl.constexpr, M: tl.constexpr,
                   M_rows):
    """The last split of an output block to arrive sums every split's partial (in split order)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT - 1:
        for m in tl.static_range(M):
            y = tl.zeros_like(offs_n.to(tl.float32))
            for j in tl.static_range(SPLIT):
                y += tl.load(ws_ptr + (j * M + m) * N + offs_n, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.store(o_ptr + m * stride_om + offs_n, y.to(o_ptr.dtype.element_ty), mask=n_ok & (m < M_rows))
        tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")


# -- NVFP4 at one row with fp16x2 arithmetic (GemvConfig.nvfp4_h2) ----------------------------------------
#
# Why: the kernel above spends ~5.3 SASS instructions per NVFP4 value (sm_90, 8x2048 tile): the shift/mask
# decode (~1.9), an fp16 -> fp32 conversion per value (1), fp32 products and a tree of partial sums (1.5),
# and a shared-memory round trip of the activations (their even/odd split changes the layout). Here:
#   - a 32-bit word of codes (8 values) is decoded by byte permutes: the fp16 encodings of the 8 E2M1
#     magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} all have a zero low byte, so one PRMT over the register pair
#     holding their 8 high bytes (E2M1_F16_HI), with selector nibbles 1 and 3 set to two codes' magnitude
#     bits and nibbles 0 and 2 zero (byte 0 of the table is 0x00), makes two fp16 values; the sign goes in
#     with one LOP3. 17 integer instructions per 8 values, no conversion to fp32;
#   - the two values of a PRMT are the codes 16 bits apart in the word (nibbles 1 and 5, 3 and 7, 0 and 4,
#     2 and 6), so one shift puts both sign bits at bits 15 and 31; the activations are paired the same way;
#   - products are summed in fp16x2 (one HFMA2 per two values) over a group of 16 columns, then the two
#     halves go to fp32 and the group's E4M3 scale multiplies them into fp32 accumulators: fp16 rounding
#     over at most 8 terms per half, fp32 everywhere else;
#   - the activations are turned into fp16 pairs once per program tile (each thread holds all BLOCK_N rows
#     of its groups, so the conversion is shared by the rows) after a multiply by 2^-X_SHIFT: fp16 stops at
#     65504, and a group's partial is at most 16 * 6 * max|x| * 2^-X_SHIFT (the 2^X_SHIFT is put back with the
#     row's tensor scale, exactly, being a power of two).
E2M1_F16_HI = (0x3E3C3800, 0x46444240)      # high bytes of fp16(0, .5, 1, 1.5) and fp16(2, 3, 4, 6)

# one group of 16 columns: $1, $2 the group's two code words; $3..$6 and $7..$10 the activation pairs of
# the first and second word, in decode order (columns 1|5, 3|7, 0|4, 2|6 of the word: low|high half);
# $11 the table's low word E2M1_F16_HI[0]; $0 the group's sum in fp32. The table's low word comes from
# memory (tab_ptr): as an immediate or a kernel argument, ptxas copied it into a fresh register before most
# PRMTs (one more instruction each: 4.19 -> 3.76 instructions per value in the 8x2048 loop without them).
E2M1_GROUP_H2_ASM = tl.constexpr("""
{
.reg .b32 t0, t1, x, so, se, sh, eh, d0, d1, d2, d3, s, h;
.reg .b16 l, u;
.reg .f32 fl, fu;
mov.b32 t0, $11; mov.b32 t1, 0x46444240;
prmt.b32 x, $1, $1, 0x3120;
and.b32 so, x, 0x70707070; shl.b32 se, x, 4; and.b32 se, se, 0x70707070;
shr.u32 sh, so, 16; shr.u32 eh, se, 16;
prmt.b32 d0, t0, t1, so; prmt.b32 d1, t0, t1, sh; prmt.b32 d2, t0, t1, se; prmt.b32 d3, t0, t1, eh;
shl.b32 s, $1, 8; and.b32 s, s, 0x80008000; or.b32 d0, d0, s;
and.b32 s, $1, 0x80008000; or.b32 d1, d1, s;
shl.b32 s, $1, 12; and.b32 s, s, 0x80008000; or.b32 d2, d2, s;
shl.b32 s, $1, 4; and.b32 s, s, 0x80008000; or.b32 d3, d3, s;
mul.rn.f16x2 h, d0, $3; fma.rn.f16x2 h, d1, $4, h; fma.rn.f16x2 h, d2, $5, h; fma.rn.f16x2 h, d3, $6, h;
prmt.b32 x, $2, $2, 0x3120;
and.b32 so, x, 0x70707070; shl.b32 se, x, 4; and.b32 se, se, 0x70707070;
shr.u32 sh, so, 16; shr.u32 eh, se, 16;
prmt.b32 d0, t0, t1, so; prmt.b32 d1, t0, t1, sh; prmt.b32 d2, t0, t1, se; prmt.b32 d3, t0, t1, eh;
shl.b32 s, $2, 8; and.b32 s, s, 0x80008000; or.b32 d0, d0, s;
and.b32 s, $2, 0x80008000; or.b32 d1, d1, s;
shl.b32 s, $2, 12; and.b32 s, s, 0x80008000; or.b32 d2, d2, s;
shl.b32 s, $2, 4; and.b32 s, s, 0x80008000; or.b32 d3, d3, s;
fma.rn.f16x2 h, d0, $7, h; fma.rn.f16x2 h, d1, $8, h; fma.rn.f16x2 h, d2, $9, h; fma.rn.f16x2 h, d3, $10, h;
mov.b32 {l, u}, h;
cvt.f32.f16 fl, l; cvt.f32.f16 fu, u;
add.f32 $0, fl, fu;
}
""")
# two fp32 values -> one fp16 pair ($1 to the high half, $2 to the low one), rounded to nearest
F16X2_PACK_ASM = tl.constexpr("cvt.rn.f16x2.f32 $0, $1, $2;")


@triton.jit
def _bf16_half(p, HIGH: tl.constexpr):
    # p: int32 holding two bf16 (column 2i low, 2i+1 high) -> the chosen one in fp32 (exact)
    if HIGH:
        return (p & -65536).to(tl.float32, bitcast=True)
    return (p << 16).to(tl.float32, bitcast=True)


@triton.jit
def _x_pair(p_a, p_b, HIGH: tl.constexpr, X_SCALE: tl.constexpr):
    # the fp16 pair (low half from p_a, high half from p_b) of scaled activations, as the PRMT decode pairs them
    lo = _bf16_half(p_a, HIGH) * X_SCALE
    hi = _bf16_half(p_b, HIGH) * X_SCALE
    return tl.inline_asm_elementwise(F16X2_PACK_ASM, "=r,r,r", [hi, lo], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _e2m1_f16(w, i: tl.constexpr):
    # w: int32 code words; nibble i -> its E2M1 value in fp16 (exact), by Triton ops (the interpreter's decode)
    c = (w >> (4 * i)) & 15
    bits = ((c & 8) << 12) | ((c & 7) << 9)                         # fp16 bits of value * 2^-14
    return (bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0).to(tl.float16)


@triton.jit
def _x_f16(p, HIGH: tl.constexpr, X_SCALE: tl.constexpr):
    return (_bf16_half(p, HIGH) * X_SCALE).to(tl.float16)


@triton.jit
def _lane(w, p0, p1, p2, p3, h, HIGH: tl.constexpr, X_SCALE: tl.constexpr):
    # one half of the fp16x2 chain over a word, in the PTX's order (columns 1, 3, 0, 2 or 5, 7, 4, 6);
    # p0..p3: the word's activation pairs (columns 0|1, 2|3, 4|5, 6|7)
    if HIGH:
        h = h + _e2m1_f16(w, 5) * _x_f16(p2, True, X_SCALE)
        h = h + _e2m1_f16(w, 7) * _x_f16(p3, True, X_SCALE)
        h = h + _e2m1_f16(w, 4) * _x_f16(p2, False, X_SCALE)
        h = h + _e2m1_f16(w, 6) * _x_f16(p3, False, X_SCALE)
    else:
        h = h + _e2m1_f16(w, 1) * _x_f16(p0, True, X_SCALE)
        h = h + _e2m1_f16(w, 3) * _x_f16(p1, True, X_SCALE)
        h = h + _e2m1_f16(w, 0) * _x_f16(p0, False, X_SCALE)
        h = h + _e2m1_f16(w, 2) * _x_f16(p1, False, X_SCALE)
    return h


@triton.jit
def _x_word(xg, i: tl.constexpr, ok, EVEN_K: tl.constexpr):
    # xg: [G] pointers to each group's first bf16 pair -> pair i of every group, [1, G] int32
    if EVEN_K:
        return tl.load(xg + i)[None, :]
    return tl.load(xg + i, mask=ok, other=0)[None, :]


@triton.jit
def _nv_tile(w_rows, s_rows, n_ok, k0, k_end, G: tl.constexpr, EVEN: tl.constexpr):
    """The code words [BN, G, 2] (int32) and raw E4M3 group scales [BN, G] of the tile at columns k0.."""
    offs_g = tl.multiple_of(k0 // 16, G) + tl.arange(0, G)                       # [G] groups
    offs_w = 2 * offs_g[None, :, None] + tl.arange(0, 2)[None, None, :]            # [1, G, 2] words
    # one scale byte per load, so that the scales land in the group sums' layout (one group a thread): as
    # vectors of 8 bytes, the sums went through shared memory with two barriers per tile
    offs_s = tl.max_contiguous(offs_g, 1)
    if EVEN:
        words = tl.load(w_rows + offs_w)
        s_raw = tl.load(s_rows + offs_s[None, :])
    else:
        g_ok = offs_g < k_end // 16
        words = tl.load(w_rows + offs_w, mask=n_ok[:, None, None] & g_ok[None, :, None], other=0)
        s_raw = tl.load(s_rows + offs_s[None, :], mask=n_ok[:, None] & g_ok[None, :], other=0.0)
    return words, s_raw


@triton.jit
def gemv_nvfp4_h2_kernel(xw_ptr, ww_ptr, s_ptr, rs_ptr, o_ptr, ws_ptr, cnt_ptr, tab_ptr, N, K, stride_wn, stride_sn,
                         k_per_split, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                         ASM: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, X_SHIFT: tl.constexpr,
                         PREFETCH: tl.constexpr, USE_PDL: tl.constexpr = False):
    """One activation row. xw_ptr: int32 [K/2] (bf16 pairs); ww_ptr: int32 [N, K/8] code words (row stride
    stride_wn words); s_ptr: fp8 [N, K/16]; rs_ptr: fp32 [N]; o_ptr: [1, N]; tab_ptr: int32 [32], each
    E2M1_F16_HI[0]."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    G: tl.constexpr = BLOCK_K // 16                                  # groups of 16 columns per tile
    X_SCALE: tl.constexpr = 2.0 ** (-X_SHIFT)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = ww_ptr + offs_n[:, None, None].to(tl.int64) * stride_wn              # [BN, 1, 1]
    s_rows = s_ptr + offs_n[:, None].to(tl.int64) * stride_sn                     # [BN, 1]
    acc = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    # E2M1_F16_HI[0], read from memory at addresses that differ between threads (32 copies) so that ptxas keeps
    # it in an ordinary register: a constant, or a load it can prove uniform, goes to a uniform register,
    # which ptxas copies again before each PRMT
    t0 = tl.load(tab_ptr + tl.arange(0, G) % 32)[None, :]
    if PREFETCH:
        words, s_raw = _nv_tile(w_rows, s_rows, n_ok, k_start, k_end, G, EVEN_K and EVEN_N)
    # the first tile (with PREFETCH) is read before the kernel ahead has finished; activations after
    pdl.wait_for_inputs(USE_PDL)
    for k0 in range(k_start, k_end, BLOCK_K):
        if PREFETCH:
            # the next tile's words go out before this tile's arithmetic (as int32: 4 codes-bytes a register)
            if EVEN_K and EVEN_N:
                # unmasked: the last iteration loads the last tile again, from L2
                k_next = tl.minimum(k0 + BLOCK_K, k_end - BLOCK_K)
                words_next, s_next = _nv_tile(w_rows, s_rows, n_ok, k_next, k_end, G, True)
            else:
                words_next, s_next = _nv_tile(w_rows, s_rows, n_ok, k0 + BLOCK_K, k_end, G, False)
        else:
            words, s_raw = _nv_tile(w_rows, s_rows, n_ok, k0, k_end, G, EVEN_K and EVEN_N)
        offs_g = tl.multiple_of(k0 // 16, G) + tl.arange(0, G)                    # [G] groups
        s = s_raw.to(tl.float32)                                                  # [BN, G]
        we, wo = tl.split(words)                                                  # [BN, G] each
        # the group's 16 activations as 8 bf16 pairs (masked groups read 0: their codes are 0 too)
        xg = xw_ptr + 8 * offs_g
        x_ok = offs_g < k_end // 16
        p0 = _x_word(xg, 0, x_ok, EVEN_K)
        p1 = _x_word(xg, 1, x_ok, EVEN_K)
        p2 = _x_word(xg, 2, x_ok, EVEN_K)
        p3 = _x_word(xg, 3, x_ok, EVEN_K)
        p4 = _x_word(xg, 4, x_ok, EVEN_K)
        p5 = _x_word(xg, 5, x_ok, EVEN_K)
        p6 = _x_word(xg, 6, x_ok, EVEN_K)
        p7 = _x_word(xg, 7, x_ok, EVEN_K)
        if ASM:
            g = tl.inline_asm_elementwise(
                E2M1_GROUP_H2_ASM, "=r,r,r,r,r,r,r,r,r,r,r,r",
                [we, wo,
                 _x_pair(p0, p2, True, X_SCALE), _x_pair(p1, p3, True, X_SCALE),
                 _x_pair(p0, p2, False, X_SCALE), _x_pair(p1, p3, False, X_SCALE),
                 _x_pair(p4, p6, True, X_SCALE), _x_pair(p5, p7, True, X_SCALE),
                 _x_pair(p4, p6, False, X_SCALE), _x_pair(p5, p7, False, X_SCALE), t0],
                dtype=tl.float32, is_pure=True, pack=1)
        else:
            h_lo = tl.zeros((BLOCK_N, G), dtype=tl.float16)
            h_hi = tl.zeros((BLOCK_N, G), dtype=tl.float16)
            h_lo = _lane(we, p0, p1, p2, p3, h_lo, False, X_SCALE)
            h_hi = _lane(we, p0, p1, p2, p3, h_hi, True, X_SCALE)
            h_lo = _lane(wo, p4, p5, p6, p7, h_lo, False, X_SCALE)
            h_hi = _lane(wo, p4, p5, p6, p7, h_hi, True, X_SCALE)
            g = h_lo.to(tl.float32) + h_hi.to(tl.float32)
        acc += g * s
        if PREFETCH:
            words, s_raw = words_next, s_next
    rs = tl.load(rs_ptr + offs_n, mask=n_ok, other=0.0) * (2.0 ** X_SHIFT)
    _finish(tl.sum(acc, axis=1) * rs, 0, o_ptr, ws_ptr, cnt_ptr, offs_n, n_ok, N, 0, pid_n, pid_k, SPLIT, 1, 1)
    if SPLIT > 1:
        _reduce_splits(o_ptr, ws_ptr, cnt_ptr, offs_n, n_ok, N, 0, pid_n, SPLIT, 1, 1)


# -- FP8 at one row with fp16x2 arithmetic (GemvConfig.fp8_h2) ----------------------------------------------
#
# Why: the kernel above converts every e4m3 value to fp32 (Triton's conversion: ~3 SASS instructions per
# value) and multiplies it by its block scale before the FMA (~7 instructions per value in all, 8x1024 tile).
# Here `cvt.rn.f16x2.e4m3x2` turns two e4m3 bytes into an fp16 pair (exact: every e4m3 value is an fp16
# value) and HFMA2 multiplies them by the activation pair; the fp16 partials go to fp32 every word (2
# products per half: F8_CHAIN = 1) or every 4 words (8 per half: F8_CHAIN = 4), and the 128-column block
# scale multiplies the fp32 sum of 16 columns. Overflow bound of a partial: 2 * F8_CHAIN * 448 * max|x| *
# 2^-X_SHIFT < 65504.
#
# one unit of 16 columns: $1..$4 the unit's 4 words of e4m3 bytes; $5..$12 its activation pairs (columns
# 0|1, 2|3, ..., 14|15: low|high half, the cvt's byte order); $0 the unit's sum in fp32
_F8_WORD = """
mov.b32 {{a0, a1}}, ${w};
cvt.rn.f16x2.e4m3x2 e0, a0; cvt.rn.f16x2.e4m3x2 e1, a1;
{first} fma.rn.f16x2 h, e1, ${x1}, h;
"""
_F8_FLUSH = """
mov.b32 {{l, u}}, h; cvt.f32.f16 fl, l; cvt.f32.f16 fu, u; {add}
"""


def _f8_unit_asm(chain: int) -> str:
    body = [".reg .b16 a0, a1, l, u;", ".reg .b32 e0, e1, h;", ".reg .f32 fl, fu, t;"]
    for w in range(4):
        fresh = w % chain == 0
        first = (f"mul.rn.f16x2 h, e0, ${5 + 2 * w};" if fresh else f"fma.rn.f16x2 h, e0, ${5 + 2 * w}, h;")
        body.append(_F8_WORD.format(w=1 + w, first=first, x1=6 + 2 * w))
        if (w + 1) % chain == 0:
            add = "add.f32 t, fl, fu;" if w + 1 == chain else "add.f32 t, t, fl; add.f32 t, t, fu;"
            body.append(_F8_FLUSH.format(add=add))
    body.append("mov.b32 $0, t;")
    return "{\n" + "\n".join(body) + "\n}"


F8_UNIT_ASM = {c: tl.constexpr(_f8_unit_asm(c)) for c in (1, 2, 4)}
F8_UNIT_ASM_1, F8_UNIT_ASM_2, F8_UNIT_ASM_4 = F8_UNIT_ASM[1], F8_UNIT_ASM[2], F8_UNIT_ASM[4]


@triton.jit
def _f8_unit(w0, w1, w2, w3, x0, x1, x2, x3, x4, x5, x6, x7, F8_CHAIN: tl.constexpr):
    args = [w0, w1, w2, w3, x0, x1, x2, x3, x4, x5, x6, x7]
    if F8_CHAIN == 1:
        g = tl.inline_asm_elementwise(F8_UNIT_ASM_1, "=r" + ",r" * 12, args, dtype=tl.float32, is_pure=True, pack=1)
    elif F8_CHAIN == 2:
        g = tl.inline_asm_elementwise(F8_UNIT_ASM_2, "=r" + ",r" * 12, args, dtype=tl.float32, is_pure=True, pack=1)
    else:
        g = tl.inline_asm_elementwise(F8_UNIT_ASM_4, "=r" + ",r" * 12, args, dtype=tl.float32, is_pure=True, pack=1)
    return g


@triton.jit
def _x_pair_nat(p, X_SCALE: tl.constexpr):
    # p: int32 bf16 pair (columns 2i, 2i+1) -> the scaled fp16 pair in the same order
    return tl.inline_asm_elementwise(F16X2_PACK_ASM, "=r,r,r",
                                     [_bf16_half(p, True) * X_SCALE, _bf16_half(p, False) * X_SCALE],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _f8_word_f16(w, xa, xb, h, FRESH: tl.constexpr, X_SCALE: tl.constexpr):
    # interpreter twin of one word of the unit asm: w int32 (4 e4m3 bytes), xa, xb its bf16 pairs; the two
    # halves of h (fp16) take columns 0, 2 and 1, 3 of the word, as HFMA2 does
    b0 = (w & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.float16)
    b1 = ((w >> 8) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.float16)
    b2 = ((w >> 16) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.float16)
    b3 = ((w >> 24) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.float16)
    lo, hi = h
    if FRESH:
        lo = b0 * _x_f16(xa, False, X_SCALE)
        hi = b1 * _x_f16(xa, True, X_SCALE)
    else:
        lo = lo + b0 * _x_f16(xa, False, X_SCALE)
        hi = hi + b1 * _x_f16(xa, True, X_SCALE)
    lo = lo + b2 * _x_f16(xb, False, X_SCALE)
    hi = hi + b3 * _x_f16(xb, True, X_SCALE)
    return lo, hi


@triton.jit
def _f8_tile(w_rows, n_ok, k0, k_end, U: tl.constexpr, EVEN: tl.constexpr):
    """The e4m3 words [BN, U, 4] (int32) of the tile at columns k0.."""
    offs_u = tl.multiple_of(k0 // 16, U) + tl.arange(0, U)                       # [U] units
    offs_w = 4 * offs_u[None, :, None] + tl.arange(0, 4)[None, None, :]            # [1, U, 4] words
    if EVEN:
        return tl.load(w_rows + offs_w)
    return tl.load(w_rows + offs_w, mask=n_ok[:, None, None] & (offs_u < k_end // 16)[None, :, None], other=0)


@triton.jit
def gemv_fp8_h2_kernel(xw_ptr, ww_ptr, s_ptr, o_ptr, ws_ptr, cnt_ptr, N, K, stride_wn, stride_sn, k_per_split,
                       scale_br, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                       ASM: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, X_SHIFT: tl.constexpr,
                       SCALE_BC: tl.constexpr, F8_CHAIN: tl.constexpr, PREFETCH: tl.constexpr,
                       USE_PDL: tl.constexpr = False):
    """One activation row. xw_ptr: int32 [K/2] (bf16 pairs); ww_ptr: int32 [N, K/4] e4m3 words (row stride
    stride_wn words); s_ptr: fp32 [N/br, K/bc] block scales; o_ptr: [1, N]. BLOCK_N divides scale_br."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    U: tl.constexpr = BLOCK_K // 16                                  # units of 16 columns (4 words) per tile
    X_SCALE: tl.constexpr = 2.0 ** (-X_SHIFT)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = ww_ptr + offs_n[:, None, None].to(tl.int64) * stride_wn              # [BN, 1, 1]
    s_row = s_ptr + ((pid_n * BLOCK_N) // scale_br) * stride_sn
    acc = tl.zeros((BLOCK_N, U), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    if PREFETCH:
        words = _f8_tile(w_rows, n_ok, k_start, k_end, U, EVEN_K and EVEN_N)
    pdl.wait_for_inputs(USE_PDL)
    for k0 in range(k_start, k_end, BLOCK_K):
        if PREFETCH:
            if EVEN_K and EVEN_N:
                k_next = tl.minimum(k0 + BLOCK_K, k_end - BLOCK_K)
                words_next = _f8_tile(w_rows, n_ok, k_next, k_end, U, True)
            else:
                words_next = _f8_tile(w_rows, n_ok, k0 + BLOCK_K, k_end, U, False)
        else:
            words = _f8_tile(w_rows, n_ok, k0, k_end, U, EVEN_K and EVEN_N)
        offs_u = tl.multiple_of(k0 // 16, U) + tl.arange(0, U)                    # [U] units
        u_ok = offs_u < k_end // 16
        if EVEN_K:
            s = tl.load(s_row + (16 * offs_u) // SCALE_BC)[None, :]                # [1, U]
        else:
            s = tl.load(s_row + (16 * offs_u) // SCALE_BC, mask=u_ok, other=0.0)[None, :]
        w02, w13 = tl.split(tl.reshape(words, (BLOCK_N, U, 2, 2)))       # words 0, 2 and 1, 3 of each unit
        w0, w2 = tl.split(w02)
        w1, w3 = tl.split(w13)
        xg = xw_ptr + 8 * offs_u
        p0 = _x_word(xg, 0, u_ok, EVEN_K)
        p1 = _x_word(xg, 1, u_ok, EVEN_K)
        p2 = _x_word(xg, 2, u_ok, EVEN_K)
        p3 = _x_word(xg, 3, u_ok, EVEN_K)
        p4 = _x_word(xg, 4, u_ok, EVEN_K)
        p5 = _x_word(xg, 5, u_ok, EVEN_K)
        p6 = _x_word(xg, 6, u_ok, EVEN_K)
        p7 = _x_word(xg, 7, u_ok, EVEN_K)
        if ASM:
            g = _f8_unit(w0, w1, w2, w3, _x_pair_nat(p0, X_SCALE), _x_pair_nat(p1, X_SCALE), _x_pair_nat(p2, X_SCALE),
                         _x_pair_nat(p3, X_SCALE), _x_pair_nat(p4, X_SCALE), _x_pair_nat(p5, X_SCALE),
                         _x_pair_nat(p6, X_SCALE), _x_pair_nat(p7, X_SCALE), F8_CHAIN)
        else:
            z = tl.zeros((BLOCK_N, U), dtype=tl.float16)
            g = tl.zeros((BLOCK_N, U), dtype=tl.float32)
            h = _f8_word_f16(w0, p0, p1, (z, z), True, X_SCALE)
            if F8_CHAIN == 1:
                g += h[0].to(tl.float32) + h[1].to(tl.float32)
            h = _f8_word_f16(w1, p2, p3, h, F8_CHAIN == 1, X_SCALE)
            if F8_CHAIN <= 2:
                g += h[0].to(tl.float32) + h[1].to(tl.float32)
            h = _f8_word_f16(w2, p4, p5, h, F8_CHAIN <= 2, X_SCALE)
            if F8_CHAIN == 1:
                g += h[0].to(tl.float32) + h[1].to(tl.float32)
            h = _f8_word_f16(w3, p6, p7, h, F8_CHAIN == 1, X_SCALE)
            g += h[0].to(tl.float32) + h[1].to(tl.float32)
        acc += g * s
        if PREFETCH:
            words = words_next
    y = tl.sum(acc, axis=1) * (2.0 ** X_SHIFT)
    _finish(y, 0, o_ptr, ws_ptr, cnt_ptr, offs_n, n_ok, N, 0, pid_n, pid_k, SPLIT, 1, 1)
    if SPLIT > 1:
        _reduce_splits(o_ptr, ws_ptr, cnt_ptr, offs_n, n_ok, N, 0, pid_n, SPLIT, 1, 1)
