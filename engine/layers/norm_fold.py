"""Decode rows with each RMSNorm and residual add folded into the GEMVs beside it (issue 15, item 3).

A Qwen3 layer at decode is four GEMVs and, between them, an add + RMSNorm kernel that moves 8 KB:

    unfolded:  x, h = norm(x + h);  qkv(x) ... o_proj -> x;  x, h = norm(x + h);  gate_up(x) ... down -> x
    folded:    qkv(norm(h)) ... h = h + o_proj(o);  gate_up(norm(h)) ... h = h + down(a)

Every program of the decode GEMV (engine/kernels/linear/gemv_triton.py) walks all of K, so the GEMV after a norm
sums the squares of the residual stream on the way, multiplies it by the norm weight, and scales each output
by the row's 1 / rms at the end (`NORM`); the GEMV before one adds its output to the stream in its epilogue
(`RESIDUAL`). That removes both norm kernels of a layer (72 of a qwen3-8b step's 73 norm launches, the final
norm stays; 0.13 ms with PDL off in the s20 profile). The add rounds where the unfused one rounds; the norm's input
reaches the products unrounded (the unfused norm rounds x / rms to bf16 before the weight), which moves outputs by
a bf16 step at most.

Taken where every layer of a stack folds: one rank, bf16 activations on CUDA, at most FOLD_ROWS rows, and
every projection on the Triton GEMV at this row count (bf16 weights at one or two rows, FP8 at one; NVFP4
rows and FP8 verify rows go to the tensor-core GEMV, which does not fold).

**Measured, and lost: off by default.** Served qwen3-8b on one H200, decode batch 1, two interleaved reps each
(bench/results/2026-12-02-h200-s23/b): bf16 4.128 / 4.126 ms a step unfolded against 4.255 / 4.253 folded, FP8
2.748 / 2.748 against 2.787 / 2.786 (NVFP4, which does not fold, 2.726 / 2.722 against 2.725 / 2.724). The
fold's per-value work (the square, the norm weight's load and multiply) lengthens the GEMV's loop by half (the
one-row bf16 kernel's sm_90 code: 184 -> 272 instructions), and that cost more than the 72 norm launches it
removed (0.13 ms of kernel time with PDL off in the s20 profile; with PDL each launches under the GEMV before
it). Not profiled: how the 0.13 ms bf16 loss splits between the GEMVs' slower loops and what the norms saved.
The residual add alone costs the GEMV nothing but saves no launch (the norm still runs).

`NINFER_GEMV_NORM_FOLD`: the most rows folded, 0 (default, off), 1 or 2. Two rows cost registers: compiled
for sm_90 (Triton 3.6) the two-row bf16 GEMV takes 95 registers with the fold against 64, capped at 80 without
a spill (6 programs an SM instead of 8); the one-row GEMV fits its 32 (gemv.NORM_MAXNREG).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from engine.layers.norm import RMSNorm

FOLD_ROWS = int(os.environ.get("NINFER_GEMV_NORM_FOLD", "0"))
if not 0 <= FOLD_ROWS <= 2:
    raise ValueError(f"NINFER_GEMV_NORM_FOLD: {FOLD_ROWS} rows; it takes 0 (off), 1 or 2")


def linear_folds(layer: nn.Module, rows: int) -> bool:
    """Whether `rows` decode rows of this linear layer (one rank) take gemv_kernel, which folds."""
    from engine.kernels.linear import gemv
    from engine.kernels.linear.quant_gemv_mma import MMA_GEMV_ROWS
    if not 1 <= rows <= min(FOLD_ROWS, gemv.NORM_MAX_ROWS):
        return False
    quant = getattr(layer, "quant", None)
    if quant is None:
        return gemv.use_gemv("bf16", rows)
    if quant == "fp8":
        return (gemv.use_gemv("fp8", rows) and rows not in MMA_GEMV_ROWS["fp8"]
                and layer.scale_block[1] % 16 == 0)
    return False


def norm_folds(norm: nn.Module) -> bool:
    return type(norm) is RMSNorm


def stack_folds(x: torch.Tensor, tp_size: int, layers) -> bool:
    """Whether x [T, hidden] goes through `layers` folded: each layer answers `folds(rows)`. Layers opt in by
    having `folds` (Qwen3DecoderLayer); the hybrids' layers have none, and their zero-centred norms would answer
    no (`norm_folds`) if a subclass inherited it."""
    rows = x.numel() // x.shape[-1]
    # CUDA first: the GEMV's module needs Triton, which a CPU install lacks
    return (FOLD_ROWS > 0 and tp_size == 1 and x.is_cuda and x.dtype == torch.bfloat16 and x.stride(-1) == 1
            and all(getattr(layer, "folds", None) is not None and layer.folds(rows) for layer in layers))


def linear(x: torch.Tensor, layer: nn.Module, norm: RMSNorm | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] -> layer(norm(x)) with `norm`, or residual + layer(x) with `residual` [T, out]: one GEMV."""
    from engine.kernels.linear import gemv
    x = x if x.stride(-1) == 1 else x.contiguous()
    nw, eps = (norm.weight, norm.eps) if norm is not None else (None, 1e-6)
    if getattr(layer, "quant", None) is None:
        return gemv.gemv(x, "bf16", layer.weight, norm_weight=nw, eps=eps, residual=residual)
    return gemv.gemv(x, "fp8", layer.weight, layer.weight_scale_inv, None, layer.out_features, layer.scale_block,
                     norm_weight=nw, eps=eps, residual=residual)


def gate_up_act(x: torch.Tensor, layer: nn.Module, norm: RMSNorm) -> torch.Tensor:
    """x [T, hidden] (the residual stream) -> silu(gate) * up of norm(x) [T, F]: the SwiGLU in the GEMV's
    epilogue where the unfolded path puts it there (`gemv.takes_gate_up_silu`), else the GEMV then the kernel."""
    from engine.kernels.linear import gemv
    if gemv.takes_gate_up_silu(x, layer):
        return gemv.layer_gate_up_silu(x, layer, norm_weight=norm.weight, eps=norm.eps)
    from engine.kernels.elementwise.norm_rope import silu_and_mul
    return silu_and_mul(linear(x, layer, norm=norm))


def run_stack(layers, positions: torch.Tensor, x: torch.Tensor, final_norm: nn.Module) -> torch.Tensor:
    """x [T, hidden] through `layers` folded (after `stack_folds` said yes), then the stack's final norm, which
    stays a kernel: its output is the hidden state the heads and the MTP module read."""
    for layer in layers:
        x = layer.forward_folded(positions, x)
    return final_norm(x)
