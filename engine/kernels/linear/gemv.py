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
    block); a thread's 16 products of one row are summed before their block's scale multiplies them
    (one multiply per 16 weights; the scale block spans a multiple of 16 columns);
  - NVFP4: a byte holds the even column in its low nibble and the odd one in the high nibble; each is
    turned into an fp16 number equal to 2^-14 times its E2M1 value (exponent 0 is fp16's subnormal,
    so 0 and 0.5 come out right) and multiplied by the even or odd activation column; the 16 values
    of a group are summed before their E4M3 scale multiplies them (one multiply per 16 values); the
    2^14 and the row's tensor scale multiply the result once. On a GPU the nibbles are decoded by
    inline PTX, four bytes (eight values) per call, with shifts and masks on 32-bit words;
  - bf16 with `pairs`: the weight and the activations are read as 32-bit words of two values; the even
    column's fp32 is the word shifted left by 16, the odd one's the word masked to its high half (one
    instruction each, where Triton's bf16 -> fp32 takes ~1.7), and each word position keeps its own fp32 sum
    (two FFMAs a word, reduced after the loop). The route is taken where x and W are 4-byte aligned with even
    row strides (`kernel_code`);
  - FP8 with `pairs`: the codes are read as 16-bit pairs (one cvt.rn.f16x2.e4m3x2 each) and the activations
    as words as above, so each thread's even and odd columns meet without a conversion of x's layout (whole
    tiles only; ragged N or K takes the plain FP8 code);
  - a folded RMSNorm (`norm_weight`, one or two rows, no split; engine/layers/norm_fold.py): x is the
    un-normed stream, each thread sums its columns' squares on the way and multiplies x by the norm weight,
    and each row's outputs are scaled by its 1 / rms at the end; a folded residual add (`residual`, no
    split): the output is the stream plus the projection, rounded as the projection then the add;
  - SPLIT > 1: each program writes its fp32 partial rows to a workspace, and the last program of an
    output block to finish (an atomic counter per block) sums the partials in order, writes the
    output and re-arms the counter, so there is one launch and the sum is deterministic.
Grids depend on shapes only (CUDA-graph safe); the workspace and counters are made once per device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton

from engine.kernels import pdl
from engine.kernels.linear.gemv_triton import (BF16_CODE, BF16_PAIRS_CODE, E2M1_ASM, FP8_CODE, FP8_PAIRS_CODE, NVFP4_CODE,
                                        gemv_kernel)
from engine.kernels.linear.quant_gemv_mma import MMA_GEMV_ROWS
from engine.kernels.linear.skinny_gemm import DENSE_MAX_ROWS, skinny_dense
from engine.kernels.linear.splitk import COUNTERS, WORKSPACE_FLOATS, workspace

__all__ = ["E2M1_ASM", "GEMV_MAX_ROWS", "GEMV_ROWS", "GemvConfig", "default_config", "dense", "gate_up_silu", "gemv",
           "kernel_code", "layer_gate_up_silu", "linear", "takes", "takes_gate_up_silu", "use_gemv"]
GEMV_MAX_ROWS = 8
NORM_MAX_ROWS = 2           # rows a folded RMSNorm takes (the kernel keeps a sum of squares for each)
PAIR_CODES = (BF16_PAIRS_CODE, FP8_PAIRS_CODE)     # the codes that read weights and activations as words


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
    preload: bool = False   # (without prefetch) the first tile before the PDL wait, each next one at the end of
                            # the iteration before: the plain loop's registers, the first tile's latency hidden
    pairs: bool = False     # bf16 activations (and bf16 weights) read as 32-bit words of two values, FP8 codes as
                            # 16-bit pairs (gemv_kernel.py); fp16 takes the plain code


# Launch shapes and row limits chosen from tools/dev/gemv_sweep.py on the H200 (bench/results/2026-11-30-h200-kern/
# sync1): the fraction of copy bandwidth summed over one layer of each kind, qwen3-8b / -32b, TP1 / TP2 shards.
#   M = 1: FP8 8x1024 tiles 0.74 / 0.88 / 0.61 / 0.73 (tensor-core skinny 0.43 / 0.50 / 0.32 / 0.41); with the scale
#          applied per 16 products (bench/results/2026-12-01-h200-s15/b-6e40bfc-fp8-gemv; 8b / 32b / 8b TP2 / 32b TP2)
#          8x1024 0.79 / 0.81 / 0.68 / 0.73; 16x1024 reached 0.80 / 0.90 / 0.66 / 0.73 there, but the served
#          qwen3-8b FP8 step was slower with it (3.09 against 3.02 ms, two interleaved reps each, s15 d); served, the
#          winner was 4x2048 (FP8_ROW_TILE below, s19);
#          NVFP4 8x2048 (narrow layers) and 16x1024 (N >= 10240) 0.42 / 0.44 / 0.35 / 0.39 (skinny 0.16-0.18);
#          bf16 4x512 0.95 / 1.03 / 0.86 / 0.97 (cuBLAS 0.89 / 0.95 / 0.74 / 0.89; a read-only stream can pass a copy).
#   M = 2: FP8 8x512 0.45-0.50 (skinny 0.32-0.50), NVFP4 8x1024 0.19-0.22 (skinny 0.13-0.17); bf16 loses to cuBLAS.
#   M = 4 and 8: the tensor-core skinny kernel (and cuBLAS for bf16) win, so the GEMV stops at 2 rows.
# bf16 at 2 rows takes the GEMV as word pairs (below): served qwen3-8b k=1 verify round 4.78 -> 4.68 ms, two
# interleaved reps each (bench/results/2026-12-01-h200-s17/b); NINFER_GEMV_BF16_ROWS=1 gives the verify rows back to
# the skinny GEMM.
GEMV_ROWS = {"fp8": 2, "nvfp4": 2, "bf16": int(os.environ.get("NINFER_GEMV_BF16_ROWS", "2"))}

# Formats whose default configs read word pairs (GemvConfig.pairs): a comma list of "bf16" and "fp8", read once
# at import like GEMV_ROWS, so a served A/B can run one tree under each setting. bf16 by default: the served
# qwen3-8b k=0 round 4.26 -> 4.22 ms; FP8 pairs lost there (fp8 step 2.89 -> 2.93 ms; same call, s17 b).
# NINFER_GEMV_PAIRS= (empty) turns them off.
PAIRS_FORMATS = frozenset(f for f in os.environ.get("NINFER_GEMV_PAIRS", "bf16").split(",") if f)

# Formats whose one-row default configs preload (GemvConfig.preload): a comma list of "bf16" and "fp8", read once
# at import. A decode step's small GEMVs (qwen3-8b q/k/v, o) are one wave of programs that walk K in two to four
# dependent tile loads; with PDL the first of them can go out while the kernel ahead finishes. Only the word-pair
# codes take it, so "fp8" needs "fp8" in NINFER_GEMV_PAIRS too. bf16 by default: the served qwen3-8b bf16 step
# 4.172 -> 4.133 ms in each of four interleaved reps (bench/results/2026-12-02-h200-s24/c, d). FP8 pairs with it
# read 2.936 ms against the plain FP8 code's 2.758 (one rep), and the plain code carries its tile as bytes (4x2048:
# 48 -> 81 registers, 488 -> 728 SASS instructions), so FP8 stays off. NINFER_GEMV_PRELOAD= turns it off.
PRELOAD_FORMATS = frozenset(f for f in os.environ.get("NINFER_GEMV_PRELOAD", "bf16").split(",") if f)
# The rows up to which those formats preload: NINFER_GEMV_PRELOAD_ROWS (1 or 2). Two rows lost served (qwen3-8b k=1
# verify round 4.568 -> 5.026 ms with 4x512 tiles, 5.035 with 2x1024; s25 d, bench/results/2026-12-02-h200-s25/):
# one row only.
PRELOAD_ROWS = max(1, min(2, int(os.environ.get("NINFER_GEMV_PRELOAD_ROWS", "1"))))


# With programmatic dependent launch (engine/kernels/pdl.py) a prefetching config loads its first weight
# tile before it waits for the kernel ahead. For bf16 at one row that did not pay on 2 x H200: 8.33 ->
# 8.36 ms per 27B TP=2 round, 4.46 -> 4.52 ms per qwen3-8b round (bench/results/2026-12-01-h200-fold/). The preload
# (above) reads that first tile early too, without the second tile in flight, and paid.


def _row_tile(setting: str, name: str = "NINFER_GEMV_FP8_TILE") -> tuple[int, int, int] | None:
    """A launch tile from an environment setting ROWSxCOLS[xWARPS] (empty: None, the per-shape rules of
    default_config); `name` is the variable the setting came from, for the error."""
    if not setting:
        return None
    parts = setting.lower().split("x")
    if len(parts) not in (2, 3) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"{name}: {setting!r} is not ROWSxCOLS or ROWSxCOLSxWARPS (e.g. 4x1024)")
    rows, cols, warps = (int(p) for p in (parts + ["4"])[:3])
    if rows & (rows - 1) or cols & (cols - 1) or warps & (warps - 1) or cols < 16:
        raise ValueError(f"{name}: {setting!r}: rows, columns and warps must be powers of two, "
                         "columns at least 16")
    return rows, cols, warps


# One row of FP8 takes 4x2048 tiles (8 KB a step, 4 warps) on every layer: the served qwen3-8b FP8 step went
# 2.847 -> 2.779 ms, four interleaved reps over two calls (s19 e, f: bench/results/2026-12-02-h200-s19/), where
# 4x1024 read 2.806, 4x4096 2.835, 8x1024 with 8 warps everywhere 2.821, 4x2048 with 8 warps 2.968 and 2x2048
# 2.874. Half the rows of the old 8x1024 tile, twice the programs; the same lesson as bf16's 2x1024 (s16).
# qwen3-32b and TP=2 shards take it too, not yet measured served. NINFER_GEMV_FP8_TILE= restores the old rules.
FP8_ROW_TILE = _row_tile(os.environ.get("NINFER_GEMV_FP8_TILE", "4x2048"))


# The tile of two bf16 rows as word pairs (a k=1 verify, two streams; the SwiGLU takes at least 4 weight rows):
# NINFER_GEMV_BF16_TWO_ROW_TILE as ROWSxCOLS[xWARPS]. 4x512 (53 registers against 4x1024's 64) lost served: k=1
# verify round 4.568 -> 4.782 ms, two streams 1.871 -> 1.783x one (s25 d).
BF16_TWO_ROW_TILE = _row_tile(os.environ.get("NINFER_GEMV_BF16_TWO_ROW_TILE", "4x1024"),
                              "NINFER_GEMV_BF16_TWO_ROW_TILE") or (4, 1024, 4)


# Register caps for the folded norm, per launch tile (sm_90, Triton 3.6, gemv_kernel compiled offline on the CPU
# machine): the one-row bf16 word-pair tile 2x1024 takes 39 registers with the fold against 32 without (16 programs
# an SM -> 12) and 32 with no spill when capped; FP8 4x2048 66 against 48 (10 -> 7), 56 with no spill (9; 48
# spills 80 bytes); two bf16 rows (4x1024, with or without the SwiGLU) 95 against 64 (8 -> 5), 80 with no spill (6;
# 72 spills 40 bytes). Keyed by (kernel code, rows, SwiGLU, BLOCK_N, BLOCK_K, warps): another tile is not capped.
NORM_MAXNREG = {(BF16_PAIRS_CODE, 1, False, 2, 1024, 4): 32, (FP8_CODE, 1, False, 4, 2048, 4): 56,
                (BF16_PAIRS_CODE, 2, False, 4, 1024, 4): 80, (BF16_PAIRS_CODE, 2, True, 4, 1024, 4): 80}


# Register caps for the preload, per launch tile (sm_90, Triton 3.6, compiled offline): the one-row bf16 word-pair
# tile 2x1024 takes 40 registers with it against 32 without (16 programs an SM -> 12: qwen3-8b's o no longer one
# wave), 32 capped with no spill; its SwiGLU tile 4x1024 64 against 48, 48 capped with no spill. FP8 pairs 4x2048
# stay at 48 uncapped.
PRELOAD_MAXNREG = {(BF16_PAIRS_CODE, 1, False, 2, 1024, 4): 32, (BF16_PAIRS_CODE, 1, True, 4, 1024, 4): 48}


def default_config(fmt: str, M: int, N: int, K: int) -> GemvConfig:
    if fmt == "fp8" and M == 1 and FP8_ROW_TILE is not None:
        cfg = GemvConfig(*FP8_ROW_TILE)
    elif fmt == "fp8":
        cfg = GemvConfig(8, 1024 if M == 1 else 512)
        if M == 1 and 6144 <= N <= 10240 and K <= 5120:
            # q/k/v-shaped layers: 0.74 / 0.81 of copy against 0.57 / 0.74 in the s15 b sweep (qwen3-8b / 32B), but
            # only 2.990 -> 2.983 ms on the served qwen3-8b FP8 step (s15 e, two interleaved reps each)
            cfg = replace(cfg, num_warps=8)
    elif fmt == "nvfp4":
        cfg = GemvConfig(16, 1024) if M == 1 and N >= 10240 else GemvConfig(8, 2048 if M == 1 else 1024)
    else:
        # one row: 2x1024 tiles (30 registers, 16 programs an SM) put 8b's o (2,048 programs) in one wave with
        # 4 steps each where 4x512 walked 8 dependent tile loads; per model 0.988 / 1.020 / 0.901 / 0.973 of copy
        # against 4x512's 0.949 / 0.920 / 0.886 / 0.861 (8b / 32b / 8b TP2 / 32b TP2, s16 sweep); served qwen3-8b
        # bf16 step 4.427 -> 4.349 ms, interleaved in one call (bench/results/2026-12-01-h200-s16/b)
        cfg = GemvConfig(2, 1024) if M == 1 else GemvConfig(8, 256)
        if M > 1 and "bf16" in PAIRS_FORMATS:
            # verify rows as pairs: at 2 rows 4x1024 reached 0.973 of copy per qwen3-8b model against the skinny
            # tensor-core GEMM's 0.935 (2x1024 pairs 0.923; s17 sweep, bench/results/2026-12-01-h200-s17/a)
            cfg = GemvConfig(*BF16_TWO_ROW_TILE)
    if fmt in PAIRS_FORMATS:
        cfg = replace(cfg, pairs=True)
    if fmt in PRELOAD_FORMATS and M <= PRELOAD_ROWS:
        cfg = replace(cfg, preload=True)
    block_k = cfg.block_k
    while K % block_k and block_k > 256:        # a tile that divides K keeps the loop unmasked
        block_k //= 2
    return replace(cfg, block_k=block_k)


def use_gemv(fmt: str, rows: int) -> bool:
    return rows <= GEMV_ROWS.get(fmt, 0)


def gemv(x: torch.Tensor, fmt: str, weight: torch.Tensor, scale: torch.Tensor | None = None,
         row_scale: torch.Tensor | None = None, out_features: int | None = None,
         scale_block: tuple[int, int] = (128, 128), config: GemvConfig | None = None,
         silu: bool = False, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
         residual: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M <= 8, K] bf16/fp16 (unit stride along K); weight: fp8 [N, K] (scale fp32 [N/br, K/bc]),
    packed uint8 [N, K/2] (scale fp8 [N, K/16], row_scale fp32 [N]) or bf16/fp16 [N, K] -> [M, N].
    silu (one or two rows, see `gate_up_silu`): -> silu(gate) * up [M, N/2], a program owning BLOCK_N / 2 gate
    rows and the matching up rows.
    norm_weight [K] (one or two rows; bf16 and FP8): x is un-normed, and the result is that of RMSNorm(x) with
    this weight and eps, then the projection (engine/layers/norm_fold.py). residual [M, N]: -> residual + x @ W^T,
    rounded as the projection then the add."""
    M, K = x.shape
    if not 1 <= M <= GEMV_MAX_ROWS:
        raise ValueError(f"gemv takes 1..{GEMV_MAX_ROWS} rows, got {M}")
    N = out_features if out_features is not None else weight.shape[0]
    if fmt == "fp8" and scale_block[1] % 16:
        raise ValueError(f"gemv: FP8 scale blocks must span a multiple of 16 columns, got {scale_block[1]}")
    if silu and M > 2:
        raise ValueError(f"gemv: the SwiGLU epilogue takes one or two rows, got {M}")
    if norm_weight is not None and (M > NORM_MAX_ROWS or fmt == "nvfp4" or norm_weight.shape != (K,)
                                    or norm_weight.dtype != x.dtype or norm_weight.stride(0) != 1):
        raise ValueError(f"gemv: a folded norm takes 1..{NORM_MAX_ROWS} rows of bf16 or FP8 and a contiguous "
                         f"{x.dtype} weight of {K} values, got {M} rows of {fmt} and a {norm_weight.dtype} weight of "
                         f"{tuple(norm_weight.shape)}")
    if residual is not None and (silu or residual.shape != (M, N) or residual.stride(-1) != 1
                                 or residual.dtype != x.dtype):
        raise ValueError(f"gemv: the residual must be {x.dtype} [{M}, {N}] with unit stride (and no SwiGLU), "
                         f"got {residual.dtype} {tuple(residual.shape)}")
    cfg = config or default_config(fmt, M, N, K)
    code = kernel_code(fmt, cfg, x, weight)
    block_n = cfg.block_n
    if fmt == "fp8":
        block_n = min(block_n, scale_block[0])           # the rows of a program share one scale row
    block_k = cfg.block_k
    rows_out = N // 2 if silu else N
    grid_n = triton.cdiv(rows_out, block_n // 2 if silu else block_n)
    # the folded norm needs every column of x in each program, the residual add the finished sum: one split
    split = 1 if silu or norm_weight is not None or residual is not None else max(1, cfg.split)
    if split > 1 and (split * triton.next_power_of_2(M) * N > WORKSPACE_FLOATS or grid_n > COUNTERS):
        split = 1
    k_per_split = triton.cdiv(triton.cdiv(K, block_k), split) * block_k
    split = triton.cdiv(K, k_per_split)
    out = torch.empty(M, rows_out, dtype=x.dtype, device=x.device)
    ws, cnt = workspace(x.device) if split > 1 else (out, out)
    s = scale if scale is not None else weight
    rs = row_scale if row_scale is not None else s
    even_k = k_per_split * split == K
    even_n = (N // 2) % (block_n // 2) == 0 if silu else N % block_n == 0
    if code == FP8_PAIRS_CODE and (silu or not (even_k and even_n)):
        code = FP8_CODE           # the pair loads are unmasked (whole tiles only) and share one scale row a program
    if norm_weight is not None and code in PAIR_CODES and norm_weight.data_ptr() % 4:
        code = BF16_CODE if code == BF16_PAIRS_CODE else FP8_CODE     # the pair codes read the norm weight as words
    asm = cfg.asm and x.is_cuda and code in (NVFP4_CODE, FP8_PAIRS_CODE)
    rows_pow2 = triton.next_power_of_2(M)      # compiled for 1, 2, 4 or 8 rows; the rows past M are masked
    prefetch = cfg.prefetch and not silu
    # the tile carried over the loop's back edge as words (the pair codes); bytes would cost registers. The folds'
    # register caps were set without it, so a folded norm or residual keeps the plain loop
    preload = (cfg.preload and not prefetch and code in PAIR_CODES and norm_weight is None and residual is None)
    tile = (code, rows_pow2, silu, block_n, block_k, cfg.num_warps)
    if norm_weight is not None:
        cap = NORM_MAXNREG.get(tile)
    elif preload and even_k and even_n and split == 1:
        # the caps were compiled for whole tiles and one split: another variant of the tile keeps its own count
        cap = PRELOAD_MAXNREG.get(tile)
    else:
        cap = None
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(x.device),
                  **({"maxnreg": cap} if cap and x.is_cuda else {}))
    gemv_kernel[(grid_n, split)](x, weight, s, rs, out, ws, cnt, M, N, K, x.stride(0), weight.stride(0),
                                  s.stride(0) if s.dim() == 2 else 0, out.stride(0), k_per_split,
                                  scale_block[0], FMT=code, SCALE_BC=scale_block[1], M=rows_pow2, BLOCK_N=block_n,
                                  BLOCK_K=block_k, SPLIT=split, ASM=asm, EVEN_K=even_k,
                                  EVEN_N=even_n, X2D=cfg.x2d, PREFETCH=prefetch, PRELOAD=preload, SILU=silu,
                                  nw_ptr=norm_weight if norm_weight is not None else s,
                                  res_ptr=residual if residual is not None else out,
                                  stride_rm=residual.stride(0) if residual is not None else 0, eps=eps,
                                  NORM=norm_weight is not None, RESIDUAL=residual is not None, **launch)
    return out


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                 scale_block: tuple[int, int] = (128, 128), norm_weight: torch.Tensor | None = None,
                 eps: float = 1e-6) -> torch.Tensor:
    """x: [M, K] bf16/fp16 (unit stride; M = 1, or 2 with a bf16 weight); weight: [2F, K], the gate rows then the up
    rows, bf16/fp16 or FP8 (scale fp32 [2F/br, K/bc] in blocks of scale_block) -> silu(x @ gate^T) * (x @ up^T)
    [M, F] in one launch: the SwiGLU of engine.layers.activation folded into the projection's GEMV, on the launch
    shape of the unfused GEMV of M rows. Each program owns BLOCK_N / 2 gate rows and the matching up rows (FP8: each
    row reads its own row of block scales)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    fmt = "fp8" if weight.dtype == torch.float8_e4m3fn else "bf16"
    rows = 2 if fmt == "bf16" else 1
    if not 1 <= M <= rows or N % 2:
        raise ValueError(f"gate_up_silu takes one row ({fmt}; bf16 up to two) and an even number of weight rows, "
                         f"got {M} and {N}")
    if fmt == "fp8" and scale is None:
        raise ValueError("gate_up_silu: an FP8 weight needs its block scales")
    cfg = default_config(fmt, M, N, K)
    cfg = replace(cfg, block_n=max(cfg.block_n, 4))     # two gate rows and their two up rows at least
    return gemv(x, fmt, weight, scale, config=cfg, silu=True, scale_block=scale_block, norm_weight=norm_weight,
                eps=eps)


# FP8 gate/up projections can fold the SwiGLU too (NINFER_GEMV_FP8_SILU=1), but it lost served: the qwen3-8b FP8
# step 2.741 ms unfused against 2.758 fused, three interleaved reps each (bench/results/2026-12-02-h200-s20/d), where
# the profile put silu_mul at 0.063 ms a step. Off: the GEMV then silu_and_mul (whose PDL launch overlaps the GEMV).
FP8_SILU = os.environ.get("NINFER_GEMV_FP8_SILU", "0") == "1"


# The GEMV's two bf16 rows (a k=1 verify, two streams) fold the SwiGLU too; NINFER_GEMV_SILU_ROWS=1 turns that off.
# The s20 profile of a k=1 round had silu_mul at 0.073 ms (37 launches) where k=0 has none. Served qwen3-8b, one
# interleaved rep (bench/results/2026-12-02-h200-s21/a): k=1 (32k draft vocab) 4.654 -> 4.612 ms, k=0 4.172 -> 4.173.
SILU_ROWS = max(1, min(2, int(os.environ.get("NINFER_GEMV_SILU_ROWS", "2"))))


def takes_gate_up_silu(x: torch.Tensor, layer) -> bool:
    """Whether a gate/up layer's input x [..., K] takes `gate_up_silu`: bf16 on CUDA, one row (or SILU_ROWS for an
    unquantized layer), the layer unquantized or FP8 where its one row would take this GEMV anyway (not the
    tensor-core quant GEMV)."""
    if not (takes(x) and x.shape[-1] == layer.in_features):
        return False
    rows = x.numel() // x.shape[-1]
    quant = getattr(layer, "quant", None)
    if quant is None:
        return 1 <= rows <= SILU_ROWS
    return (quant == "fp8" and FP8_SILU and rows == 1 and use_gemv("fp8", 1) and 1 not in MMA_GEMV_ROWS["fp8"]
            and layer.scale_block[1] % 16 == 0)


def layer_gate_up_silu(x: torch.Tensor, layer, norm_weight: torch.Tensor | None = None,
                       eps: float = 1e-6) -> torch.Tensor:
    """`gate_up_silu` of a gate/up layer (unquantized or FP8) that `takes_gate_up_silu(x, layer)`: x [..., K] ->
    [..., F]; norm_weight: x is the un-normed stream and the RMSNorm is folded in (engine/layers/norm_fold.py)."""
    x2 = x.reshape(-1, x.shape[-1])
    if getattr(layer, "quant", None) is None:
        act = gate_up_silu(x2, layer.weight, norm_weight=norm_weight, eps=eps)
    else:
        act = gate_up_silu(x2, layer.weight, layer.weight_scale_inv, layer.scale_block, norm_weight=norm_weight,
                           eps=eps)
    return act.view(*x.shape[:-1], act.shape[-1])


def kernel_code(fmt: str, cfg: GemvConfig, x: torch.Tensor, weight: torch.Tensor) -> int:
    """The gemv_kernel format code a call takes: the word-pair codes where the config asks and x [M, K] and
    weight [N, K] allow it (bf16 values: the bit trick is bf16's; aligned words), else the format's own. FP8
    pairs also need whole tiles, which `gemv` checks after it sizes them."""
    if cfg.pairs and x.dtype == torch.bfloat16:
        if fmt == "bf16" and weight.dtype == torch.bfloat16 and _word_aligned(x, weight):
            return BF16_PAIRS_CODE
        if fmt == "fp8" and cfg.x2d and _word_aligned(x, weight.view(torch.uint8)):
            return FP8_PAIRS_CODE
    return {"fp8": FP8_CODE, "nvfp4": NVFP4_CODE, "bf16": BF16_CODE}[fmt]


def _word_aligned(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x [M, K] (2-byte values) can be read as 32-bit words and weight [N, ...] as words of its own
    (bf16 values, or an FP8 tensor viewed as bytes): even K and row strides, 4-byte aligned bases (fixed at
    capture, so a graph replays the route it captured)."""
    return (x.shape[1] % 2 == 0 and (x.shape[0] == 1 or x.stride(0) % 2 == 0) and weight.stride(0) % 2 == 0
            and x.data_ptr() % 4 == 0 and weight.data_ptr() % 4 == 0)


def takes(x: torch.Tensor) -> bool:
    """Whether a bf16 dense layer's input x [..., K] goes to the GEMV (CUDA, decode rows: where it beat cuBLAS)."""
    return x.is_cuda and x.dtype == torch.bfloat16 and use_gemv("bf16", x.numel() // x.shape[-1])


def takes_skinny(x: torch.Tensor) -> bool:
    """Whether x [..., K] (bf16, CUDA) goes to the tensor-core skinny GEMM: 2..16 rows (two streams, an MTP
    verify), where it beat cuBLAS on the H200 (qwen3-8b layer 0.89 vs 0.86 of copy, lm_head 1.06 vs 0.99)."""
    rows = x.numel() // x.shape[-1]
    return (x.is_cuda and x.dtype == torch.bfloat16 and GEMV_ROWS["bf16"] < rows <= DENSE_MAX_ROWS
            and x.shape[-1] % 8 == 0 and os.environ.get("NINFER_SKINNY_DENSE", "1") != "0")


def dense(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # x: [..., K]; weight: [N, K] -> x @ weight^T [..., N]: the GEMV at one row, the skinny tensor-core GEMM at
    # 2..16, else cuBLAS
    if takes(x):
        return linear(x, weight)
    if takes_skinny(x) and weight.stride(-1) == 1:
        x2 = x.reshape(-1, x.shape[-1])
        return skinny_dense(x2 if x2.stride(-1) == 1 else x2.contiguous(), weight).view(*x.shape[:-1], weight.shape[0])
    return torch.nn.functional.linear(x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # x: [..., K] bf16; weight: bf16 [N, K] -> [..., N] (a dense layer's decode rows)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return gemv(x2, "bf16", weight).view(*x.shape[:-1], weight.shape[0])
