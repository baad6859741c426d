"""All-reduce fused with the residual add and the next RMSNorm: one launch per decoder half-layer.

A TP decoder layer ends each of its two halves with `all_reduce(partial)`, then `h = sum +
residual`, then `RMSNorm(h)`. `ADD_NORM_SOURCE` is a variant of the one-shot P2P all-reduce
(`engine.distributed.cuda_communicator`, whose protocol, flags and staging it shares: the same epoch counter, so
fused and plain calls may follow each other in any order) that, after summing the ranks' partials,
adds the residual, writes the new residual and writes the normed output:

    s = round(partial_0 + ... + partial_{world-1})      fp32 sum in rank order, as the plain kernel
    h = round(s + residual)                              written to residual_out
    y = round(round(h * rstd) * w)                       RMSNorm (engine.layers.norm)
    y = round(h * rstd * (1 + w))                        zero-centred (engine.layers.hybrid_norm)
    rstd = rsqrt(mean(h^2) + eps)                        over the row, fp32

rounding where the unfused ops round ("round" = to the activation dtype). Every rank runs the same
grid over the same numbers in the same order, so the outputs are bitwise equal across ranks.

Launch shape: one block per row (a token's hidden vector), blocks striding over rows when there are
more rows than MAX_BLOCKS; a block's threads cover the row in 16-byte words (threads = words
rounded up to a warp, at most 1024), so the row's sum of squares is one block reduction. A block
stages all its rows, signals and waits per the protocol, then reduces them row by row; `x` is only
read before the signal, so `out` may alias `x` (peers read the staged copy).

`add_norm_reference` is the same computation in torch (fp32, rounding at the same points), for
the tests on any machine.
"""

from __future__ import annotations

import torch

from engine.kernels.cuda_source import read_cuda_source

ADD_NORM_SOURCE = read_cuda_source(__file__, "allreduce_add_norm.cu")

ADD_NORM_KERNEL_NAMES = {kind: f"ninfer_ar_add_norm_{kind}" for kind in ("f32", "f16", "bf16")}


def add_norm_launch_shape(rows: int, row_bytes: int, max_blocks: int) -> tuple[int, int, int]:
    """(blocks, threads, 16-byte words per row) for `rows` rows of `row_bytes` (a multiple of 16):
    a function of the sizes only, so every rank runs the same grid."""
    units = row_bytes // 16
    threads = min(1024, max(32, -(-units // 32) * 32))
    return min(rows, max_blocks), threads, units


def add_norm_reference(parts: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """What the fused kernel computes, in torch: parts (one partial per rank, [..., H]),
    residual [..., H], weight [H] -> (normed [..., H], new residual [..., H]), rounded to the
    activation dtype where the unfused ops (all_reduce, add, RMSNorm) round."""
    dtype = parts[0].dtype
    total = parts[0].float().clone()
    for p in parts[1:]:
        total += p.float()
    h = (total.to(dtype).float() + residual.float()).to(dtype)
    normed = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)
    if zero_centred:
        out = normed * (1.0 + weight.float())
    else:
        out = normed.to(dtype).float() * weight.float()
    return out.to(dtype), h

