"""bf16/fp16 weights at 1..16 decode rows on tensor cores: y[M, N] = x[M, K] @ W[N, K]^T.

Routed from gemv.dense for 2..16 rows (two streams, an MTP verify); one row stays on the GEMV (gemv.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels import pdl
from engine.kernels.linear.splitk import COUNTERS, WORKSPACE_FLOATS, num_sms, workspace
from engine.kernels.tuned import load_tuned


# Why: at 2-8 rows cuBLAS reads the weight at 0.64-0.83 of copy bandwidth on the narrow layers (its split-K
# kernels plus a separate reduce launch), and the FMA GEMV of gemv.py falls behind it past one row. The
# weight is read once whatever M is, so the work is the weight stream: each program streams [BLOCK_N,
# BLOCK_K] weight tiles through shared memory (cp.async, or TMA with `tma=True`, `num_stages` deep) straight
# into wgmma as its first operand (the MMA's 64-row side), against x^T [BLOCK_K, 16] as the second (rows
# padded to 16 by the load's mask). No instruction touches a weight value outside the copy engine and the
# tensor cores. K is split over programs where the output alone gives too few of them; the partials go to
# fp32 workspace and the last program of an output block to arrive sums them in split order (deterministic)
# and re-arms its counter, so a call is one launch (splitk.py's workspace and counters, shared with the GEMV:
# every launch leaves them zero).

# M and the split count are run-time values that Triton would otherwise specialize (1, multiples of 16): one
# compiled kernel serves every row count up to BLOCK_M and every split > 1 of a launch shape
@triton.jit(do_not_specialize=["M", "split"])
def _skinny_dense_kernel(x_ptr, w_ptr, w_desc, o_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                         k_per_split, split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT_K: tl.constexpr, EVEN: tl.constexpr, TMA: tl.constexpr, USE_PDL: tl.constexpr = False):
    # x: [M, K]; w: [N, K] (w_desc: its TMA descriptor, block [BLOCK_N, BLOCK_K]); o: [M, N];
    # ws: fp32 [split, M, N] partials (SPLIT_K: split > 1); cnt: int32 [>= grid_n] arrivals per output block,
    # zero between launches
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok, m_ok = offs_n < N, offs_m < M
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn              # [BN, 1]
    x_cols = x_ptr + offs_m[None, :] * stride_xm                          # [1, BM]: x^T's columns are x's rows
    # the activations are the kernel ahead's output: nothing is read before it has finished
    pdl.wait_for_inputs(USE_PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k0 = tl.multiple_of(k0, BLOCK_K)        # k_per_split is a multiple of BLOCK_K: no tile straddles a split
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if TMA:
            w = w_desc.load([n0, k0])            # rows past N and columns past K come back zero
        elif EVEN:
            w = tl.load(w_rows + offs_k[None, :])
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k[None, :] < K), other=0.0)
        xt = tl.load(x_cols + offs_k[:, None], mask=m_ok[None, :] & (offs_k[:, None] < K), other=0.0)
        acc = tl.dot(w, xt, acc)                                            # [BN, BM] fp32
    o = o_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    ok = m_ok[None, :] & n_ok[:, None]
    if not SPLIT_K:
        tl.store(o, acc.to(o_ptr.dtype.element_ty), mask=ok)
    else:
        part = ws_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]   # row m of split 0
        tl.store(part + pid_k.to(tl.int64) * M * N, acc, mask=ok)
        # every thread's partial is stored before the one arrival; acq_rel orders them against the last
        # program's reads of the others' partials (which go around L1: .cg)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == split - 1:
            y = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for j in range(split):                                          # split order: the same sum every call
                y += tl.load(part + j * M * N, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(o, y.to(o_ptr.dtype.element_ty), mask=ok)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")


@dataclass(frozen=True)
class DenseConfig:
    block_n: int = 64          # the wgmma's M side (64 per warpgroup)
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    split: int = 0             # 0: from the shape (programs_per_sm, min_k_tiles); 1: no split
    programs_per_sm: int = 2   # what split=0 aims at: the programs resident at once (80 KB of shared memory each)
    min_k_tiles: int = 4       # a split keeps at least this many tiles, so the pipeline fills
    # split=0 rounds the split down, so the grid stays within programs_per_sm * SMs: equal programs that are
    # all resident at once finish together, where a few left over for a second wave run with few bytes in
    # flight (qkv at BLOCK_N 64: 96 output blocks x 2 = 192 programs rather than x 3 = 288 on 264 slots);
    # split_up rounds it up (at least programs_per_sm * SMs programs)
    split_up: bool = False
    tma: bool = False          # the weight tile by a TMA descriptor instead of cp.async (CUDA only)


DENSE_MAX_ROWS = 16


# Written by tools/dev/skinny_bf16_sweep.py --write into tuned/h200.json (section "skinny_dense", which names the run),
# M = 2..8: "narrow", the best single shape over the qwen3-8b layers (64 x 256 tiles, 3 stages, one program per SM:
# 0.89 of copy bandwidth for qkv + o + gate_up + down against cuBLAS's 0.86; TP=2 shards 0.76 against 0.75), and
# "wide", the best for outputs of at least "wide_n" features, lm_head-sized (128 x 128 tiles: 1.05-1.06 against
# cuBLAS's 0.99). Without the file: DenseConfig's defaults for every shape.
_TUNED = load_tuned(__file__, "skinny_dense", {"wide_n": 0, "wide": {}, "narrow": {}})
WIDE_N = int(_TUNED["wide_n"])
WIDE_CONFIG = DenseConfig(**_TUNED["wide"])
NARROW_CONFIG = DenseConfig(**_TUNED["narrow"])


def default_dense_config(M: int, N: int, K: int) -> DenseConfig:
    """Launch shape per call shape (tools/dev/skinny_bf16_sweep.py measures the alternatives on the H200)."""
    return WIDE_CONFIG if N >= WIDE_N else NARROW_CONFIG


def dense_split(cfg: DenseConfig, M: int, N: int, K: int, sms: int) -> tuple[int, int]:
    """(split, k_per_split) from the shapes only (CUDA-graph safe): split K until the grid nears (or, with
    split_up, passes) programs_per_sm programs per SM, keeping min_k_tiles tiles per split and the partials
    inside the workspace."""
    grid_n = triton.cdiv(N, cfg.block_n)
    k_tiles = triton.cdiv(K, cfg.block_k)
    if cfg.split:
        split = cfg.split
    else:
        slots = cfg.programs_per_sm * sms
        want = triton.cdiv(slots, grid_n) if cfg.split_up else slots // grid_n
        split = max(1, min(want, k_tiles // cfg.min_k_tiles))
    if split > 1 and (split * M * N > WORKSPACE_FLOATS or grid_n > COUNTERS):
        split = max(1, min(split, WORKSPACE_FLOATS // (M * N)))
        if grid_n > COUNTERS:
            split = 1
    split = min(split, k_tiles)
    k_per_split = triton.cdiv(k_tiles, split) * cfg.block_k
    return triton.cdiv(K, k_per_split), k_per_split       # no empty split


def skinny_dense(x: torch.Tensor, weight: torch.Tensor, config: DenseConfig | None = None) -> torch.Tensor:
    """x: [M <= 16, K] bf16/fp16 (unit stride along K); weight: [N, K] same dtype (unit stride along K)
    -> x @ weight^T [M, N] in x's dtype, fp32 accumulation."""
    M, K = x.shape
    N = weight.shape[0]
    if not 1 <= M <= DENSE_MAX_ROWS:
        raise ValueError(f"skinny_dense takes 1..{DENSE_MAX_ROWS} rows, got {M}")
    if weight.shape[1] != K or weight.dtype != x.dtype or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"skinny_dense: x {tuple(x.shape)} {x.dtype} against weight {tuple(weight.shape)} "
                         f"{weight.dtype}")
    cfg = config or default_dense_config(M, N, K)
    split, k_per_split = dense_split(cfg, M, N, K, num_sms(x.device))
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    ws, cnt = workspace(x.device) if split > 1 else (out, out)
    desc = None
    # TMA: 16-byte aligned base and row stride (the descriptor's rules), else cp.async; the interpreter (tests)
    # emulates descriptors too
    tma = (cfg.tma and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and weight.data_ptr() % 16 == 0
           and (weight.stride(0) * weight.element_size()) % 16 == 0)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        desc = TensorDescriptor(weight, [N, K], [weight.stride(0), 1], [cfg.block_n, cfg.block_k])
    grid = (triton.cdiv(N, cfg.block_n), split)
    even = N % cfg.block_n == 0 and K % cfg.block_k == 0
    _skinny_dense_kernel[grid](x, weight, desc, out, ws, cnt, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
                               k_per_split, split, BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=cfg.block_n,
                               BLOCK_K=cfg.block_k, SPLIT_K=split > 1, EVEN=even,
                               TMA=tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                               **pdl.launch_options(x.device))
    return out
