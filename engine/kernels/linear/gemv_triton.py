"""The Triton code of the decode GEMV (launched by engine/kernels/linear/gemv.py, whose docstring says how it works).

One program: BLOCK_N output rows x one slice of K, walked BLOCK_K columns at a time; M (1, 2, 4 or 8,
the rows past the caller's count masked) activation rows accumulated in separate registers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels import pdl

FP8_CODE, NVFP4_CODE, BF16_CODE = 0, 1, 2
# bf16 read as 32-bit words of two values: each half becomes an fp32 by one shift or one mask (the even column
# is the low half), for the weights and the activations alike, where the bf16 -> fp32 conversion took ~1.7
# instructions per value in the sm_90 SASS
BF16_PAIRS_CODE = 3

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
def _x_cols(x_ptr, row_ok, k0, k_end, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
            X2D: tl.constexpr):
    """One activation row's columns k0.. in fp32: [BN, BK] (X2D: the weight tile's own shape, each thread loading
    the columns it multiplies, from L1, so no layout conversion through shared memory is needed) or [1, BK]."""
    offs_x = k0 + tl.arange(0, BLOCK_K)
    if X2D:
        x_ptrs = x_ptr + offs_x[None, :] + tl.zeros((BLOCK_N, 1), dtype=tl.int32)
    else:
        x_ptrs = (x_ptr + offs_x)[None, :]
    if EVEN_K:
        return tl.load(x_ptrs, mask=row_ok, other=0.0).to(tl.float32)
    return tl.load(x_ptrs, mask=(offs_x[None, :] < k_end) & row_ok, other=0.0).to(tl.float32)


@triton.jit
def _row_part(w_lo, w_hi, s, x_ptr, row_ok, k0, k_end, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, VEC: tl.constexpr, EVEN_K: tl.constexpr, X2D: tl.constexpr):
    """One activation row's in-thread partial sums over a tile: [BLOCK_N, BLOCK_K // VEC] fp32."""
    if FMT == 1:
        offs_x = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_ptr + offs_x, mask=row_ok, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptr + offs_x, mask=(offs_x < k_end) & row_ok, other=0.0).to(tl.float32)
        # activation columns 2j meet the low nibbles, 2j+1 the high ones
        xe, xo = tl.split(tl.reshape(x, (BLOCK_K // 2, 2)))
        prod = w_lo * xe[None, :] + w_hi * xo[None, :]
        part = tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // 16, 8)), axis=2) * s    # [BN, BK/16] group scales
    else:
        x2 = _x_cols(x_ptr, row_ok, k0, k_end, BLOCK_N, BLOCK_K, EVEN_K, X2D)
        # FP8: s is the block scale of each thread's VEC columns, [1, BK/VEC] or per row [BN, BK/VEC] (1.0 for bf16)
        part = tl.sum(tl.reshape(w_lo * x2, (BLOCK_N, BLOCK_K // VEC, VEC)), axis=2) * s
    return part


@triton.jit
def _accumulate(acc, w_lo, w_hi, s, x_ptr, row_ok, k0, k_end, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, VEC: tl.constexpr, EVEN_K: tl.constexpr, X2D: tl.constexpr):
    """acc plus one activation row's products with the tile, w_lo / w_hi the even / odd columns in the pair
    code. bf16 words (FMT 3): acc [BN, BK/2] keeps a sum per word position, two FFMAs a word. Else acc [BN, COLS]
    += _row_part."""
    if FMT == 3:
        x_even, x_odd = _bf16_pair(_x_words(x_ptr, row_ok, k0, k_end, BLOCK_N, BLOCK_K, EVEN_K, X2D))
        acc = tl.fma(w_lo, x_even, acc)
        acc = tl.fma(w_hi, x_odd, acc)
    else:
        acc += _row_part(w_lo, w_hi, s, x_ptr, row_ok, k0, k_end, FMT, BLOCK_N, BLOCK_K, VEC, EVEN_K, X2D)
    return acc


@triton.jit
def _x_words(x_ptr, row_ok, k0, k_end, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
             X2D: tl.constexpr):
    """One activation row's columns k0.. as 32-bit words of two bf16: [BN, BK/2] (X2D, the weight tile's shape)
    or [1, BK/2]."""
    offs_w = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    x_words = x_ptr.to(tl.pointer_type(tl.uint32)) + offs_w[None, :]
    if X2D:
        x_words = x_words + tl.zeros((BLOCK_N, 1), dtype=tl.int32)
    if EVEN_K:
        return tl.load(x_words, mask=row_ok, other=0)
    return tl.load(x_words, mask=(offs_w[None, :] * 2 < k_end) & row_ok, other=0)


@triton.jit
def _bf16_pair(words):
    """32-bit words of two bf16 -> the even (low half) and odd (high half) values in fp32: a shift and a mask."""
    return (words << 16).to(tl.float32, bitcast=True), (words & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_scale_row(s_ptr, row_blk, stride_sn, k0, k_end, BLOCK_K: tl.constexpr, SCALE_BC: tl.constexpr,
                   EVEN: tl.constexpr):
    """The program's FP8 block scales, one per 16 columns from k0: [BK/16] (16 divides the scale block), or
    [BN, BK/16] when row_blk is a column [BN, 1] of each row's block row."""
    offs_v = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    if EVEN:
        return tl.load(s_ptr + row_blk * stride_sn + offs_v // (SCALE_BC // 16))
    return tl.load(s_ptr + row_blk * stride_sn + offs_v // (SCALE_BC // 16), mask=offs_v * 16 < k_end, other=0.0)


@triton.jit
def _load_tile(w_rows, s_ptr, offs_n, n_ok, stride_sn, row_blk, k0, k_end, FMT: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN: tl.constexpr, SCALE_BC: tl.constexpr):
    """The raw weight tile at columns k0.. (packed bytes, fp8, bf16 or its 32-bit words) and its scales (NVFP4: fp8
    [BN, BK/16]; FP8: fp32 [BK/16] of the program's scale row; bf16: the tile again, unused)."""
    if FMT == 3:
        offs = k0 // 2 + tl.arange(0, BLOCK_K // 2)                          # 32-bit words of two bf16
        offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK_K // 2), BLOCK_K // 2)
        if EVEN:
            raw = tl.load(w_rows + offs[None, :])
        else:
            raw = tl.load(w_rows + offs[None, :], mask=n_ok[:, None] & (offs[None, :] * 2 < k_end), other=0)
        s_raw = raw
    elif FMT == 1:
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
            s_raw = _fp8_scale_row(s_ptr, row_blk, stride_sn, k0, k_end, BLOCK_K, SCALE_BC, EVEN)
        else:
            s_raw = raw
    return raw, s_raw


@triton.jit
def _load_next_tile(w_rows, s_ptr, offs_n, n_ok, stride_sn, row_blk, k0, k_end, FMT: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN: tl.constexpr, SCALE_BC: tl.constexpr):
    """The tile after the one at k0, for a load issued ahead of its iteration. Unmasked (16-byte loads), the last
    iteration loads the last tile again, from L2; masked, the tile past k_end reads nothing."""
    if EVEN:
        k_next = tl.multiple_of(tl.minimum(k0 + BLOCK_K, k_end - BLOCK_K), BLOCK_K)
        raw, s_raw = _load_tile(w_rows, s_ptr, offs_n, n_ok, stride_sn, row_blk, k_next, k_end, FMT, BLOCK_K, True,
                                SCALE_BC)
    else:
        raw, s_raw = _load_tile(w_rows, s_ptr, offs_n, n_ok, stride_sn, row_blk, k0 + BLOCK_K, k_end, FMT, BLOCK_K,
                                False, SCALE_BC)
    return raw, s_raw


@triton.jit
def gemv_kernel(x_ptr, w_ptr, s_ptr, rs_ptr, o_ptr, ws_ptr, cnt_ptr, M_rows, N, K, stride_xm, stride_wn, stride_sn,
                 stride_om, k_per_split, scale_br,
                 FMT: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                 SCALE_BC: tl.constexpr, X2D: tl.constexpr, USE_PDL: tl.constexpr = False,
                 SILU: tl.constexpr = False, PRELOAD: tl.constexpr = False):
    # PRELOAD (gemv() sets it for the bf16 word code 3 only): the plain loop's one tile in flight, but the first
    # tile is read before the PDL wait and each next one at the end of the iteration before it. Carried over the
    # loop's back edge as words a tile costs few registers; as bytes (the plain FP8 code) it took 48 -> 81 (sm_90).
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    if SILU:
        # a fused gate/up projection (N = 2F rows of bf16 or fp16, gate then up): this program's first BLOCK_N / 2
        # rows are gate rows, the rest the up rows of the same outputs, and it stores silu(gate) * up (one or two
        # rows, no split)
        HB: tl.constexpr = BLOCK_N // 2
        j = tl.arange(0, BLOCK_N)
        out_row = pid_n * HB + j % HB
        offs_n = tl.where(j < HB, out_row, N // 2 + out_row)
        n_ok = out_row < N // 2
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
    if FMT == 3:
        w_rows = w_ptr.to(tl.pointer_type(tl.uint32)) + offs_n[:, None].to(tl.int64) * (stride_wn // 2)
    else:
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    VEC: tl.constexpr = 16 if FMT == 0 else 8
    COLS: tl.constexpr = BLOCK_K // 16 if FMT == 1 else (BLOCK_K // 2 if FMT == 3 else BLOCK_K // VEC)
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
    if PRELOAD:
        raw, s_raw = _load_tile(w_rows, s_ptr, offs_n, n_ok, stride_sn, row_blk, k_start, k_end, FMT, BLOCK_K,
                                EVEN_K and EVEN_N, SCALE_BC)
    # the first weight tile (with PRELOAD) is read before the kernel ahead has finished; the activations, the
    # split-K workspace and the output only after
    pdl.wait_for_inputs(USE_PDL)
    for k0 in range(k_start, k_end, BLOCK_K):
        k0 = tl.multiple_of(k0, BLOCK_K)            # k_per_split is a multiple of BLOCK_K
        if not PRELOAD:
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
        elif FMT == 3:
            w_lo, w_hi = _bf16_pair(raw)                                    # even, odd columns: [BN, BK/2]
            s = 1.0
        else:
            w_lo = raw.to(tl.float32)
            w_hi = w_lo
            if FMT == 0:
                # [1, BK/16]: applied to each run of 16 products, not to every weight
                s = s_raw[None, :]
            else:
                s = 1.0
        acc0 = _accumulate(acc0, w_lo, w_hi, s, x_ptr, M_rows > 0, k0, k_end, FMT, BLOCK_N, BLOCK_K, VEC, EVEN_K, X2D)
        if M > 1:
            acc1 = _accumulate(acc1, w_lo, w_hi, s, x_ptr + stride_xm, M_rows > 1, k0, k_end, FMT, BLOCK_N, BLOCK_K,
                               VEC, EVEN_K, X2D)
        if M > 2:
            acc2 = _accumulate(acc2, w_lo, w_hi, s, x_ptr + 2 * stride_xm, M_rows > 2, k0, k_end, FMT, BLOCK_N,
                               BLOCK_K, VEC, EVEN_K, X2D)
        if M > 3:
            acc3 = _accumulate(acc3, w_lo, w_hi, s, x_ptr + 3 * stride_xm, M_rows > 3, k0, k_end, FMT, BLOCK_N,
                               BLOCK_K, VEC, EVEN_K, X2D)
        if M > 4:
            acc4 = _accumulate(acc4, w_lo, w_hi, s, x_ptr + 4 * stride_xm, M_rows > 4, k0, k_end, FMT, BLOCK_N,
                               BLOCK_K, VEC, EVEN_K, X2D)
        if M > 5:
            acc5 = _accumulate(acc5, w_lo, w_hi, s, x_ptr + 5 * stride_xm, M_rows > 5, k0, k_end, FMT, BLOCK_N,
                               BLOCK_K, VEC, EVEN_K, X2D)
        if M > 6:
            acc6 = _accumulate(acc6, w_lo, w_hi, s, x_ptr + 6 * stride_xm, M_rows > 6, k0, k_end, FMT, BLOCK_N,
                               BLOCK_K, VEC, EVEN_K, X2D)
        if M > 7:
            acc7 = _accumulate(acc7, w_lo, w_hi, s, x_ptr + 7 * stride_xm, M_rows > 7, k0, k_end, FMT, BLOCK_N,
                               BLOCK_K, VEC, EVEN_K, X2D)
        if PRELOAD:
            # this tile's registers are free now: the next tile's load goes out
            raw, s_raw = _load_next_tile(w_rows, s_ptr, offs_n, n_ok, stride_sn, row_blk, k0, k_end, FMT, BLOCK_K,
                                         EVEN_K and EVEN_N, SCALE_BC)
    if FMT == 1:
        rs = tl.load(rs_ptr + offs_n, mask=n_ok, other=0.0) * 16384.0
    else:
        rs = tl.full((BLOCK_N,), 1.0, tl.float32)
    if SILU:
        # one or two rows (M <= 2, no split): each row's silu(gate) * up
        _finish_silu(tl.sum(acc0, axis=1) * rs, o_ptr, pid_n, N // 2, BLOCK_N, True)
        if M > 1:
            _finish_silu(tl.sum(acc1, axis=1) * rs, o_ptr + stride_om, pid_n, N // 2, BLOCK_N, M_rows > 1)
    else:
        _finish(tl.sum(acc0, axis=1) * rs, 0, o_ptr, ws_ptr, cnt_ptr, offs_n, n_ok, N, stride_om,
                pid_n, pid_k, SPLIT, M, M_rows)
    if M > 1 and not SILU:
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
def _finish_silu(y, o_ptr, pid_n, F, BLOCK_N: tl.constexpr, row_ok):
    # y: [BN] fp32, gate rows then up rows of BN / 2 outputs -> silu(gate) * up, rounded where the unfused
    # twins round (the projection's output, silu before the product: engine/kernels/elementwise/norm_rope.py silu_and_mul)
    dt = o_ptr.dtype.element_ty
    HB: tl.constexpr = BLOCK_N // 2
    g, u = tl.split(tl.permute(tl.reshape(y.to(dt).to(tl.float32), (2, HB)), (1, 0)))
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    rows = pid_n * HB + tl.arange(0, HB)
    tl.store(o_ptr + rows, (s * u).to(dt), mask=(rows < F) & row_ok)


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
