"""The gated delta rule in plain torch (float32): the CPU path and the reference for the GPU kernels.

Per value head, with a state S of shape [dk, dv], each token t (q_t, k_t in R^dk, v_t in R^dv, a
log-decay g_t <= 0 and a write strength beta_t in (0, 1)) does

    S  <- exp(g_t) * S                        decay
    u_t = beta_t * (v_t - S^T k_t)            the part of v_t that S does not yet predict
    S  <- S + k_t u_t^T                       delta-rule write
    o_t = S^T q_t

(Yang, Kautz, Hatamizadeh: "Gated Delta Networks", 2024). `recurrent` runs that loop (decode,
verify, committing a verified prefix); `chunked` computes the same thing a chunk at a time (prefill).

Chunked form. Inside a chunk starting from state S0, let G_t = g_1 + ... + g_t (cumulative log
decay). Unrolling the loop gives

    u_t = beta_t v_t - beta_t e^{G_t} S0^T k_t - sum_{j<t} beta_t e^{G_t - G_j} (k_t . k_j) u_j

i.e. (I + A) U = beta V - (beta e^G K) S0 with A[t, j] = beta_t e^{G_t-G_j} (k_t . k_j) strictly
lower triangular: one unit-lower-triangular solve per chunk gives every u_t. Then

    o_t = e^{G_t} S0^T q_t + sum_{j<=t} e^{G_t - G_j} (q_t . k_j) u_j
    S_C = e^{G_C} S0 + sum_j e^{G_C - G_j} k_j u_j^T

All inputs come prepared: q, k already L2-normalised, q already scaled. Shapes: q, k [B, T, Hk, dk]
with Hk dividing H (each key head serves H / Hk consecutive value heads); v [B, T, H, dv]; g, beta
[B, T, H]; state [B, H, dk, dv] float32 (read, not written). Returns o [B, T, H, dv] float32 and the
final state. `engine.kernels.gated_delta.fla` has the same interface on CUDA (fla-core's kernels).
"""

from __future__ import annotations

import torch


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rep = v.shape[2] // q.shape[2]
    return (q, k) if rep == 1 else (q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2))


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = _grouped(q, k, v)
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    s = state.float().clone()                                                  # [B, H, dk, dv]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, t], s)
        u = beta[:, t, :, None] * (v[:, t] - predicted)                        # [B, H, dv]
        s = s + k[:, t, :, :, None] * u[:, :, None, :]
        out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], s)
    return out, s


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = _grouped(q, k, v)
    q, k, v, g, beta = (x.float().transpose(1, 2) for x in (q, k, v, g, beta))   # heads before time
    s = state.float().clone()                                                  # [B, H, dk, dv]
    total = q.shape[2]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)           # [B, H, T, dv]
    for start in range(0, total, chunk):
        end = min(start + chunk, total)
        qc, kc, vc, gc, bc = (x[:, :, start:end] for x in (q, k, v, g, beta))
        n = end - start
        cum = gc.cumsum(-1)                                                    # G_t: [B, H, n]
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        # e^{G_t - G_j} for j <= t, zero above the diagonal (masked before exp: no overflow)
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
        a = (bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)     # strictly lower
        system = a + torch.eye(n, device=q.device)
        rhs_v = bc[..., None] * vc                                             # beta V
        rhs_s = (bc * cum.exp())[..., None] * kc                               # beta e^G K
        u_v = torch.linalg.solve_triangular(system, rhs_v, upper=False, unitriangular=True)
        u_s = torch.linalg.solve_triangular(system, rhs_s, upper=False, unitriangular=True)
        u = u_v - u_s @ s                                                      # [B, H, n, dv]
        inner = (qc @ kc.transpose(-1, -2)) * decay                            # [B, H, n, n]
        out[:, :, start:end] = (cum.exp()[..., None] * qc) @ s + inner @ u
        tail = (cum[..., -1:] - cum).exp()[..., None] * kc                     # e^{G_C - G_j} k_j
        s = cum[..., -1].exp()[..., None, None] * s + tail.transpose(-1, -2) @ u
    return out.transpose(1, 2), s
