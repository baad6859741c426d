"""The gated delta rule on CUDA through PyPI `fla-core` (flash-linear-attention's Triton kernels), with
the interface of `engine.kernels.gated_delta.reference` (which the GPU tests hold it to):

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


def compile_for(num_k_heads: int, num_v_heads: int, dk: int, dv: int, dtype: torch.dtype,
                device: torch.device) -> None:
    """Run both kernels once at a layer's head shapes, so that Triton compiles and autotunes them for
    this device now. Under tensor parallelism each rank must do it before its first collective: a rank
    still autotuning inside its first prefill leaves the others waiting in an all-reduce (seen on
    2 x H200: the P2P all-reduce gave up waiting)."""
    with torch.cuda.device(device):
        for t in (64, 1):
            q = torch.nn.functional.normalize(torch.randn(1, t, num_k_heads, dk, device=device), dim=-1).to(dtype)
            v = torch.randn(1, t, num_v_heads, dv, device=device, dtype=dtype)
            g = -torch.rand(1, t, num_v_heads, device=device)
            beta = torch.rand(1, t, num_v_heads, device=device).to(dtype)
            state = torch.zeros(1, num_v_heads, dk, dv, device=device)
            (chunked if t > 1 else recurrent)(q, q, v, g, beta, state)
        torch.cuda.synchronize(device)
