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
  - `preload` (bf16 words, one row): the first weight tile is read before the kernel waits for the one ahead
    (engine/kernels/pdl.py), each next one at the end of the iteration before it;
  - a SwiGLU epilogue (`gate_up_silu`, bf16 or fp16 weights, one or two rows): a program owns gate rows and the
    matching up rows and stores silu(gate) * up;
  - SPLIT > 1: each program writes its fp32 partial rows to a workspace, and the last program of an
    output block to finish (an atomic counter per block) sums the partials in order, writes the
    output and re-arms the counter, so there is one launch and the sum is deterministic.
Grids depend on shapes only (CUDA-graph safe); the workspace and counters are made once per device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton

from engine import envs
from engine.kernels import pdl
from engine.kernels.linear.gemv_triton import BF16_CODE, BF16_PAIRS_CODE, E2M1_ASM, FP8_CODE, NVFP4_CODE, gemv_kernel
from engine.kernels.linear.skinny_gemm import DENSE_MAX_ROWS, skinny_dense
from engine.kernels.linear.splitk import COUNTERS, WORKSPACE_FLOATS, workspace

__all__ = ["E2M1_ASM", "GEMV_MAX_ROWS", "GEMV_ROWS", "GemvConfig", "default_config", "dense", "gate_up_silu", "gemv",
           "kernel_code", "layer_gate_up_silu", "linear", "takes", "takes_gate_up_silu", "use_gemv"]
GEMV_MAX_ROWS = 8


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int           # weight values (not bytes) per tile along K
    num_warps: int = 4
    num_stages: int = 1
    split: int = 1
    asm: bool = True       # NVFP4: decode nibbles by inline PTX (CUDA only; the interpreter takes Triton ops)
    x2d: bool = True       # FP8/bf16: load the activations in the weight tile's shape (no layout conversion)
    preload: bool = False   # the first tile before the PDL wait, each next one at the end of the iteration before:
                            # the plain loop's registers, the first tile's latency hidden (bf16 words only)
    pairs: bool = False     # bf16 activations and bf16 weights read as 32-bit words of two values (gemv_triton.py);
                            # fp16 and the quantized formats take their plain codes


# Launch shapes and row limits chosen from tools/dev/gemv_sweep.py on the H200 (bench/results/2026-11-30-h200-kern/
# sync1): the fraction of copy bandwidth summed over one layer of each kind, qwen3-8b / -32b, TP1 / TP2 shards.
#   M = 1: FP8 see FP8_ROW_TILE; NVFP4 8x2048 (narrow layers) and 16x1024 (N >= 10240) 0.42 / 0.44 / 0.35 / 0.39
#          (skinny 0.16-0.18); bf16 see default_config.
#   M = 2: FP8 8x512 0.45-0.50 (skinny 0.32-0.50), NVFP4 8x1024 0.19-0.22 (skinny 0.13-0.17).
#   M = 4 and 8: the tensor-core skinny kernel (and cuBLAS for bf16) win, so the GEMV stops at 2 rows.
# bf16 takes the GEMV at two rows too, as word pairs: served qwen3-8b k=1 verify round 4.78 -> 4.68 ms, two
# interleaved reps each (bench/results/2026-12-01-h200-gemv-pairs/b-ab-3d5ae26-pairs-rows2); at 4 rows the skinny GEMM
# keeps it (0.935 of copy against the pairs' 0.735, bench/results/2026-12-01-h200-gemv-pairs/a-39355ec-tests-pairs-sweep).
GEMV_ROWS = {"fp8": 2, "nvfp4": 2, "bf16": 2}

# bf16 reads word pairs (GemvConfig.pairs): the served qwen3-8b k=0 round 4.26 -> 4.22 ms
# (bench/results/2026-12-01-h200-gemv-pairs/b-ab-3d5ae26-pairs-rows2). Read once at import; NINFER_GEMV_PAIRS=0 restores
# the plain code, and the two-row GEMV then takes 8x256 tiles.
PAIRS = envs.GEMV_PAIRS.read()

# The one-row bf16 word-pair GEMV preloads (GemvConfig.preload): a decode step's small GEMVs (qwen3-8b q/k/v, o)
# are one wave of programs that walk K in two to four dependent tile loads, and with PDL the first of them can go
# out while the kernel ahead finishes. Served qwen3-8b bf16 step 4.172 -> 4.133 ms in each of four interleaved reps
# (bench/results/2026-12-02-h200-preload-quant-8b/c-9ad8c47-ab-preload, d-9ad8c47-ab-preload-bf16). One row only: at two rows
# it lost (k=1 verify 4.568 -> 5.026 ms, bench/results/2026-12-02-h200-bench-profiles/d-ab0d812-ab-two-row-gemv).
# NINFER_GEMV_PRELOAD=0 restores the plain loop.
PRELOAD = envs.GEMV_PRELOAD.read()

# One row of FP8 takes 4x2048 tiles (8 KB a step, 4 warps) on every layer: the served qwen3-8b FP8 step went
# 2.847 -> 2.779 ms against the 8x1024 tiles it replaced, four interleaved reps over two calls, where 4x1024 read
# 2.806, 4x4096 2.835, 8x1024 with 8 warps 2.821, 4x2048 with 8 warps 2.968 and 2x2048 2.874
# (bench/results/2026-12-02-h200-mma-chunks-fp8-tiles/e-da127a8-ab-fp8-row-tile, f-da127a8-ab-fp8-row-tile-2). qwen3-32b and TP=2
# shards take it too, not measured served.
FP8_ROW_TILE = (4, 2048, 4)

# Two bf16 rows as word pairs (a k=1 verify, two streams; the SwiGLU takes at least 4 weight rows): 4x1024.
# 4x512 (53 registers against 64) lost served: k=1 verify round 4.568 -> 4.782 ms, two streams 1.871 -> 1.783x one
# (bench/results/2026-12-02-h200-bench-profiles/d-ab0d812-ab-two-row-gemv).
BF16_TWO_ROW_TILE = (4, 1024, 4)


# Register caps for the preload, per launch tile (sm_90, Triton 3.6, compiled offline): the one-row bf16 word-pair
# tile 2x1024 takes 40 registers with it against 32 without (16 programs an SM -> 12: qwen3-8b's o no longer one
# wave), 32 capped with no spill; its SwiGLU tile 4x1024 64 against 48, 48 capped with no spill.
PRELOAD_MAXNREG = {(BF16_PAIRS_CODE, 1, False, 2, 1024, 4): 32, (BF16_PAIRS_CODE, 1, True, 4, 1024, 4): 48}


def default_config(fmt: str, M: int, N: int, K: int) -> GemvConfig:
    if fmt == "fp8":
        cfg = GemvConfig(*FP8_ROW_TILE) if M == 1 else GemvConfig(8, 512)
    elif fmt == "nvfp4":
        cfg = GemvConfig(16, 1024) if M == 1 and N >= 10240 else GemvConfig(8, 2048 if M == 1 else 1024)
    else:
        # one row: 2x1024 tiles (30 registers, 16 programs an SM) put 8b's o (2,048 programs) in one wave with
        # 4 steps each where 4x512 walked 8 dependent tile loads; per model 0.988 / 1.020 / 0.901 / 0.973 of copy
        # against 4x512's 0.949 / 0.920 / 0.886 / 0.861 (8b / 32b / 8b TP2 / 32b TP2,
        # bench/results/2026-12-01-h200-gemv-tiles/a-9d1c5b0-tests-bf16-sweep); served qwen3-8b bf16 step 4.427 -> 4.349
        # ms, interleaved in one call (bench/results/2026-12-01-h200-gemv-tiles/b-ab-small-kernels-bf16-tiles)
        cfg = GemvConfig(2, 1024) if M == 1 else GemvConfig(8, 256)
        if PAIRS:
            # verify rows as pairs: at 2 rows 4x1024 reached 0.973 of copy per qwen3-8b model against the skinny
            # tensor-core GEMM's 0.935 and 2x1024 pairs' 0.923
            # (bench/results/2026-12-01-h200-gemv-pairs/a-39355ec-tests-pairs-sweep)
            cfg = replace(GemvConfig(*BF16_TWO_ROW_TILE) if M > 1 else cfg, pairs=True, preload=PRELOAD and M == 1)
    block_k = cfg.block_k
    while K % block_k and block_k > 256:        # a tile that divides K keeps the loop unmasked
        block_k //= 2
    return replace(cfg, block_k=block_k)


def use_gemv(fmt: str, rows: int) -> bool:
    return rows <= GEMV_ROWS.get(fmt, 0)


def gemv(x: torch.Tensor, fmt: str, weight: torch.Tensor, scale: torch.Tensor | None = None,
         row_scale: torch.Tensor | None = None, out_features: int | None = None,
         scale_block: tuple[int, int] = (128, 128), config: GemvConfig | None = None,
         silu: bool = False) -> torch.Tensor:
    """x: [M <= 8, K] bf16/fp16 (unit stride along K); weight: fp8 [N, K] (scale fp32 [N/br, K/bc]),
    packed uint8 [N, K/2] (scale fp8 [N, K/16], row_scale fp32 [N]) or bf16/fp16 [N, K] -> [M, N].
    silu (one or two rows of a bf16/fp16 weight, see `gate_up_silu`): -> silu(gate) * up [M, N/2], a program owning
    BLOCK_N / 2 gate rows and the matching up rows."""
    M, K = x.shape
    if not 1 <= M <= GEMV_MAX_ROWS:
        raise ValueError(f"gemv takes 1..{GEMV_MAX_ROWS} rows, got {M}")
    N = out_features if out_features is not None else weight.shape[0]
    if fmt == "fp8" and scale_block[1] % 16:
        raise ValueError(f"gemv: FP8 scale blocks must span a multiple of 16 columns, got {scale_block[1]}")
    if silu and (M > 2 or fmt != "bf16"):
        raise ValueError(f"gemv: the SwiGLU epilogue takes one or two rows of a bf16/fp16 weight, got {M} of {fmt}")
    cfg = config or default_config(fmt, M, N, K)
    code = kernel_code(fmt, cfg, x, weight)
    block_n = cfg.block_n
    if fmt == "fp8":
        block_n = min(block_n, scale_block[0])           # the rows of a program share one scale row
    block_k = cfg.block_k
    rows_out = N // 2 if silu else N
    grid_n = triton.cdiv(rows_out, block_n // 2 if silu else block_n)
    split = 1 if silu else max(1, cfg.split)          # the SwiGLU needs the finished sums: one split
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
    asm = cfg.asm and x.is_cuda and code == NVFP4_CODE
    rows_pow2 = triton.next_power_of_2(M)      # compiled for 1, 2, 4 or 8 rows; the rows past M are masked
    # the tile carried over the loop's back edge as words (the pair code); bytes would cost registers
    preload = cfg.preload and code == BF16_PAIRS_CODE
    tile = (code, rows_pow2, silu, block_n, block_k, cfg.num_warps)
    # the caps were compiled for whole tiles and one split: another variant of the tile keeps its own count
    cap = PRELOAD_MAXNREG.get(tile) if preload and even_k and even_n and split == 1 else None
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(x.device),
                  **({"maxnreg": cap} if cap and x.is_cuda else {}))
    gemv_kernel[(grid_n, split)](x, weight, s, rs, out, ws, cnt, M, N, K, x.stride(0), weight.stride(0),
                                  s.stride(0) if s.dim() == 2 else 0, out.stride(0), k_per_split,
                                  scale_block[0], FMT=code, SCALE_BC=scale_block[1], M=rows_pow2, BLOCK_N=block_n,
                                  BLOCK_K=block_k, SPLIT=split, ASM=asm, EVEN_K=even_k,
                                  EVEN_N=even_n, X2D=cfg.x2d, PRELOAD=preload, SILU=silu, **launch)
    return out


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [M, K] bf16/fp16 (unit stride; M = 1 or 2); weight: bf16/fp16 [2F, K], the gate rows then the up rows ->
    silu(x @ gate^T) * (x @ up^T) [M, F] in one launch: the SwiGLU of engine.layers.activation folded into the
    projection's GEMV, on the launch shape of the unfused GEMV of M rows. Each program owns BLOCK_N / 2 gate rows
    and the matching up rows."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    if not 1 <= M <= 2 or N % 2 or weight.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gate_up_silu takes one or two rows and an even number of bf16/fp16 weight rows, got {M} "
                         f"and {N} of {weight.dtype}")
    cfg = default_config("bf16", M, N, K)
    cfg = replace(cfg, block_n=max(cfg.block_n, 4))     # two gate rows and their two up rows at least
    return gemv(x, "bf16", weight, config=cfg, silu=True)


# The GEMV's one and two bf16 rows (a k=1 verify, two streams) fold the SwiGLU. One row, on 4x1024 tiles: the
# qwen3-8b bf16 step 4.282 -> 4.265 ms (bench/results/2026-12-01-h200-gemv-tiles/c-ab-e9d4c55-silu-pdl-fp8-sweep); two
# rows: k=1 round 4.654 -> 4.612 and 4.667 -> 4.619 ms, two streams 1.885 -> 1.906x one, k=0 unchanged
# (bench/results/2026-12-02-h200-kv-int8-long/a-2b9f21b-validate, e-d8e4bed-ab-silu-rows).
SILU_ROWS = 2


def takes_gate_up_silu(x: torch.Tensor, layer) -> bool:
    """Whether a gate/up layer's input x [..., K] takes `gate_up_silu`: bf16 on CUDA, one or SILU_ROWS rows, the
    layer unquantized (a quantized layer's SwiGLU stays a kernel of its own)."""
    if not (takes(x) and x.shape[-1] == layer.in_features):
        return False
    rows = x.numel() // x.shape[-1]
    return getattr(layer, "quant", None) is None and 1 <= rows <= SILU_ROWS


def layer_gate_up_silu(x: torch.Tensor, layer) -> torch.Tensor:
    """`gate_up_silu` of an unquantized gate/up layer that `takes_gate_up_silu(x, layer)`: x [..., K] -> [..., F]."""
    act = gate_up_silu(x.reshape(-1, x.shape[-1]), layer.weight)
    return act.view(*x.shape[:-1], act.shape[-1])


def kernel_code(fmt: str, cfg: GemvConfig, x: torch.Tensor, weight: torch.Tensor) -> int:
    """The gemv_kernel format code a call takes: the bf16 word-pair code where the config asks and x [M, K] and
    weight [N, K] allow it (bf16 values: the bit trick is bf16's; aligned words), else the format's own."""
    if (cfg.pairs and fmt == "bf16" and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and _word_aligned(x, weight)):
        return BF16_PAIRS_CODE
    return {"fp8": FP8_CODE, "nvfp4": NVFP4_CODE, "bf16": BF16_CODE}[fmt]


def _word_aligned(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x [M, K] and weight [N, K] (2-byte values) can be read as 32-bit words: even K and row strides,
    4-byte aligned bases (fixed at capture, so a graph replays the route it captured)."""
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
            and x.shape[-1] % 8 == 0 and envs.SKINNY_DENSE.read())


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
