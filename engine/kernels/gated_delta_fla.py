"""The gated delta rule on CUDA through PyPI `fla-core` (flash-linear-attention's Triton kernels), with
the interface of `engine.kernels.gated_delta_ref` (which the GPU tests hold it to):

- `chunked`: `chunk_gated_delta_rule` (prefill chunks);
- `recurrent`: `fused_recurrent_gated_delta_rule` (decode steps, verify passes, commits).

Inputs arrive prepared (q, k L2-normalised, q scaled), so the kernels run with scale 1 and no
in-kernel normalisation; key heads stay grouped (fla's grouped value attention, Hv a multiple of
Hk). q, k, v and beta go in the model dtype, g and the state in float32; the output comes back in
float32 like the reference's, the final state in float32.
"""

from __future__ import annotations

import torch


def _run(fn, q, k, v, g, beta, state):
    dtype = v.dtype
    o, final = fn(q.to(dtype).contiguous(), k.to(dtype).contiguous(), v.to(dtype).contiguous(),
                  g=g.float().contiguous(), beta=beta.to(dtype).contiguous(), scale=1.0,
                  initial_state=state.float().contiguous(), output_final_state=True)
    return o.float(), final.float()


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    return _run(fused_recurrent_gated_delta_rule, q, k, v, g, beta, state)


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    return _run(chunk_gated_delta_rule, q, k, v, g, beta, state)
