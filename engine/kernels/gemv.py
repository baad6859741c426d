"""Decode GEMV for M = 1..8 rows without tensor cores: y[M, N] = x[M, K] @ W[N, K]^T, weight streamed once.

At decode the weight is read once per step and each weight value meets at most 8 activation rows, so
the work per value is the load, the conversion to fp32 and M FMAs; tensor cores buy nothing there and
their tile layouts cost conversions (the `skinny` kernel of quant_gemm.py). Each program owns BLOCK_N
output rows and a slice of K (all of K unless SPLIT > 1) and walks it BLOCK_K columns at a time:

  - the weight tile [BLOCK_N, BLOCK_K] is loaded 16 bytes per thread and converted in registers;
  - each activation row contributes an elementwise product summed only inside each thread's own 8 or
    16 columns (a reshape and a sum over the last axis), so the cross-thread reduction happens once,
    after the loop, not once per tile;
  - FP8 128x128 blocks: the program's rows share one row of block scales (BLOCK_N divides the scale
    block), loaded once per tile as BLOCK_K values and multiplied into the converted weight once,
    whatever the number of rows;
  - NVFP4: a byte holds the even column in its low nibble and the odd one in the high nibble; each is
    turned into an fp16 number equal to 2^-14 times its E2M1 value (exponent 0 is fp16's subnormal,
    so 0 and 0.5 come out right) and multiplied by the even or odd activation column; the 16 values
    of a group are summed before their E4M3 scale multiplies them (one multiply per 16 values); the
    2^14 and the row's tensor scale multiply the result once. On a GPU the nibbles are decoded by
    inline PTX, four bytes (eight values) per call, with shifts and masks on 32-bit words;
  - SPLIT > 1: each program writes its fp32 partial rows to a workspace, and the last program of an
    output block to finish (an atomic counter per block) sums the partials in order, writes the
    output and re-arms the counter, so there is one launch and the sum is deterministic.
Grids depend on shapes only (CUDA-graph safe); the workspace and counters are made once per device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

FP8_CODE, NVFP4_CODE, BF16_CODE = 0, 1, 2
GEMV_MAX_ROWS = 8

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
def _gemv_kernel(x_ptr, w_ptr, s_ptr, rs_ptr, o_ptr, ws_ptr, cnt_ptr, M_rows, N, K, stride_xm, stride_wn, stride_sn,
                 stride_om, k_per_split, scale_br,
                 FMT: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                 SCALE_BC: tl.constexpr, X2D: tl.constexpr, PREFETCH: tl.constexpr):
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


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int           # weight values (not bytes) per tile along K
    num_warps: int = 4
    num_stages: int = 1
    split: int = 1
    asm: bool = True       # NVFP4: decode nibbles by inline PTX (CUDA only; the interpreter takes Triton ops)
    x2d: bool = True       # FP8/bf16: load the activations in the weight tile's shape (no layout conversion)
    prefetch: bool = False  # load the next tile before this one's arithmetic


# Launch shapes and row limits chosen from tools/gemv_sweep.py on the H200 (bench/results/2026-11-30-h200-kern/
# sync1): the fraction of copy bandwidth summed over one layer of each kind, qwen3-8b / -32b, TP1 / TP2 shards.
#   M = 1: FP8 8x1024 tiles 0.74 / 0.88 / 0.61 / 0.73 (tensor-core skinny 0.43 / 0.50 / 0.32 / 0.41);
#          NVFP4 8x2048 (narrow layers) and 16x1024 (N >= 10240) 0.42 / 0.44 / 0.35 / 0.39 (skinny 0.16-0.18);
#          bf16 4x512 0.95 / 1.03 / 0.86 / 0.97 (cuBLAS 0.89 / 0.95 / 0.74 / 0.89; a read-only stream can pass a copy).
#   M = 2: FP8 8x512 0.45-0.50 (skinny 0.32-0.50), NVFP4 8x1024 0.19-0.22 (skinny 0.13-0.17); bf16 loses to cuBLAS.
#   M = 4 and 8: the tensor-core skinny kernel (and cuBLAS for bf16) win, so the GEMV stops at 2 rows.
GEMV_ROWS = {"fp8": 2, "nvfp4": 2, "bf16": 1}
_WORK: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
WORKSPACE_FLOATS = 1 << 20      # SPLIT * M * N fp32 partials at most (4 MiB)
COUNTERS = 1 << 16              # output blocks at most


def default_config(fmt: str, M: int, N: int, K: int) -> GemvConfig:
    if fmt == "fp8":
        cfg = GemvConfig(8, 1024 if M == 1 else 512)
    elif fmt == "nvfp4":
        cfg = GemvConfig(16, 1024) if M == 1 and N >= 10240 else GemvConfig(8, 2048 if M == 1 else 1024)
    else:
        cfg = GemvConfig(4, 512) if M == 1 else GemvConfig(8, 256)
    block_k = cfg.block_k
    while K % block_k and block_k > 256:        # a tile that divides K keeps the loop unmasked
        block_k //= 2
    return replace(cfg, block_k=block_k)


def use_gemv(fmt: str, rows: int) -> bool:
    return rows <= GEMV_ROWS.get(fmt, 0)


def _workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device.type, device.index)
    if key not in _WORK:
        # zeroed once; every launch that counts re-arms its counters, so they stay zero between launches
        _WORK[key] = (torch.empty(WORKSPACE_FLOATS, dtype=torch.float32, device=device),
                      torch.zeros(COUNTERS, dtype=torch.int32, device=device))
    return _WORK[key]


def gemv(x: torch.Tensor, fmt: str, weight: torch.Tensor, scale: torch.Tensor | None = None,
         row_scale: torch.Tensor | None = None, out_features: int | None = None,
         scale_block: tuple[int, int] = (128, 128), config: GemvConfig | None = None) -> torch.Tensor:
    """x: [M <= 8, K] bf16/fp16 (unit stride along K); weight: fp8 [N, K] (scale fp32 [N/br, K/bc]),
    packed uint8 [N, K/2] (scale fp8 [N, K/16], row_scale fp32 [N]) or bf16/fp16 [N, K] -> [M, N]."""
    M, K = x.shape
    if not 1 <= M <= GEMV_MAX_ROWS:
        raise ValueError(f"gemv takes 1..{GEMV_MAX_ROWS} rows, got {M}")
    N = out_features if out_features is not None else weight.shape[0]
    cfg = config or default_config(fmt, M, N, K)
    code = {"fp8": FP8_CODE, "nvfp4": NVFP4_CODE, "bf16": BF16_CODE}[fmt]
    block_n = cfg.block_n
    if fmt == "fp8":
        block_n = min(block_n, scale_block[0])           # the rows of a program share one scale row
    block_k = cfg.block_k
    grid_n = triton.cdiv(N, block_n)
    split = max(1, cfg.split)
    if split > 1 and (split * triton.next_power_of_2(M) * N > WORKSPACE_FLOATS or grid_n > COUNTERS):
        split = 1
    k_per_split = triton.cdiv(triton.cdiv(K, block_k), split) * block_k
    split = triton.cdiv(K, k_per_split)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    ws, cnt = _workspace(x.device) if split > 1 else (out, out)
    s = scale if scale is not None else weight
    rs = row_scale if row_scale is not None else s
    asm = cfg.asm and x.is_cuda and code == NVFP4_CODE
    rows_pow2 = triton.next_power_of_2(M)      # compiled for 1, 2, 4 or 8 rows; the rows past M are masked
    _gemv_kernel[(grid_n, split)](x, weight, s, rs, out, ws, cnt, M, N, K, x.stride(0), weight.stride(0),
                                  s.stride(0) if s.dim() == 2 else 0, out.stride(0), k_per_split,
                                  scale_block[0], FMT=code, SCALE_BC=scale_block[1], M=rows_pow2, BLOCK_N=block_n,
                                  BLOCK_K=block_k, SPLIT=split, ASM=asm, EVEN_K=(k_per_split * split == K),
                                  EVEN_N=(N % block_n == 0), X2D=cfg.x2d, PREFETCH=cfg.prefetch,
                                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # x: [..., K] bf16; weight: bf16 [N, K] -> [..., N] (a dense layer's decode rows)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return gemv(x2, "bf16", weight).view(*x.shape[:-1], weight.shape[0])
