"""The end of a tensor-parallel decoder half-layer: all-reduce, residual add, next RMSNorm.

With TP > 1 the row-parallel projections that close attention and the MLP (`o_proj`, `out_proj`,
`down_proj`) leave their outputs unreduced (`defer_reduce`), and the layer hands the partial sum to
`reduce_add_norm`, which runs

    h = all_reduce(partial) + residual;  return norm(h), h

as one launch where the communicator has the fused kernel (the one-shot P2P all-reduce on CUDA:
`engine.distributed.fused_allreduce`), and as the unfused ops otherwise (NCCL, messages above the P2P limit,
the in-process CPU ranks, norms other than RMSNorm / ZeroCentredRMSNorm). With one rank it is
the norm alone.

Contract of the decoder layers' `forward(positions, x, residual)` under TP > 1: x is this rank's
partial sum whenever residual is not None (the first layer gets the reduced embedding and
residual None), and the layer returns the MLP's partial sum with the residual.

`NINFER_TP_FUSED_NORM=0` in the environment turns the fused kernel off (for before/after
measurements); the results agree to the rounding of the norm's row sum. The fusion removed 72 kernels per
qwen3-8b TP=2 round, and TP=2 decode went from 4.64 to 4.15 ms a token (bench/results/2026-11-30-h200-tpfuse/).
"""

from __future__ import annotations

import torch
from torch import nn

from engine import envs
from engine.layers.hybrid_norm import ZeroCentredRMSNorm
from engine.layers.norm import RMSNorm
from engine.distributed.tp_group import TPGroup

FUSED = envs.TP_FUSED_NORM.read()


def defer_reduce(tp: TPGroup, *projections: nn.Module) -> bool:
    """Make these row-parallel layers (or sparse MoE blocks: anything with a `reduce` flag) return partial
    sums when tp has several ranks; True if so."""
    deferred = tp.size > 1
    for p in projections:
        p.reduce = not deferred
    return deferred


def reduce_add_norm(tp: TPGroup, norm: nn.Module, x: torch.Tensor,
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: this rank's partial [T, hidden] (the reduced value with one rank); residual: [T, hidden].
    Returns (norm(sum + residual), sum + residual), the contract of RMSNorm.forward with a residual."""
    if tp.size > 1:
        if FUSED and type(norm) in (RMSNorm, ZeroCentredRMSNorm):
            fused = getattr(tp.comm, "all_reduce_add_rms_norm", None)
            if fused is not None:
                got = fused(tp.rank, x, residual, norm.weight, norm.eps,
                            zero_centred=isinstance(norm, ZeroCentredRMSNorm))
                if got is not None:
                    return got
        x = tp.all_reduce(x)
    return norm(x, residual)
