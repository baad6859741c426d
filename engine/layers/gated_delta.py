"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5-class hybrids.

    [q k v] = causal depthwise conv1d (width 4) over in_proj_qkv(x), then SiLU
    q, k    = L2-normalised per head (q also scaled by dk^-1/2); key heads serve groups of value heads
    beta    = sigmoid(in_proj_b(x));  g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)
    o       = gated delta rule (engine.kernels.gated_delta.reference) from the request's state
    out     = out_proj(GatedRMSNorm(o, z = in_proj_z(x)))

A request's state lives in a slot of `self.state` (engine.worker.state_pool), picked by
`ForwardContext.state_slots`. Three uses:
- prefill chunks and decode steps read the slot and write the state after their tokens back;
- a verify pass (`ctx.defer_state_commit`) reads the slot, computes every position's output, writes
  nothing and keeps its per-position inputs; `commit(num_kept)` then replays the recurrence over
  the first num_kept tokens of each row only (later steps masked to beta = 0, g = 0, which leave
  the state exactly unchanged), so rejected drafts never reach the state. Keeping inputs instead of
  k+1 states costs a few KB per row instead of (k+1) recurrent matrices.

On CUDA, runs of at most RECURRENT_MAX_TOKENS tokens (decode, verify, commit) take two fused
kernels (engine.kernels.gated_delta.decode_step) that update the slot in place; prefill chunks take the
general path below with fla-core's kernels.

The input projections run as two matmuls (`GatedDeltaInProj`: q k v z, and b a; two, because
a quantized checkpoint may leave the small b and a unquantized). Tensor parallelism: key and value
heads (and the conv channels of each of q, k, v) split over the ranks; out_proj is row-parallel (its
all-reduce is the layer's only communication).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.worker.forward_context import get_forward_context
from engine.kernels.gated_delta import reference as gated_delta_ref
from engine.layers.hybrid_norm import GatedRMSNorm
from engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear, expand_loaded
from engine.distributed.tp_group import SINGLE_RANK, TPGroup

# Runs of at most this many new tokens use the recurrent form (decode, verify, short chunks).
RECURRENT_MAX_TOKENS = 16


def load_sections(param: nn.Parameter, loaded: torch.Tensor, sizes: list[int], tp: TPGroup) -> None:
    """Copy this rank's share of each section of a tensor fused along dim 0 (global sizes `sizes`)."""
    dst, src = 0, 0
    for size in sizes:
        local = size // tp.size
        param.data.narrow(0, dst, local).copy_(loaded.narrow(0, src + tp.rank * local, local).view(
            local, *param.shape[1:]))
        dst, src = dst + local, src + size


class GatedDeltaInProj(MergedColumnParallelLinear):
    """Input projections of the checkpoint fused into one matmul, each split over the ranks. `parts`
    maps a checkpoint projection (the shard id) to its sections: in_proj_qkv is three (q, k, v)."""

    def __init__(self, hidden: int, parts: dict[str, list[int]], tp: TPGroup, quant: str | None = None):
        self.first_section, sizes = {}, []
        for name, sections in parts.items():
            self.first_section[name] = (len(sizes), sections)
            sizes += sections
        super().__init__(hidden, sizes, tp, quant)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        first, sections = self.first_section[shard_id]
        if getattr(param, "along_cols", False):               # an act-order g_idx: over the input, not the sections
            self.load_rows(param, loaded, first)
            return
        per_tensor = loaded.numel() == 1                      # a per-tensor scale: every section's rows
        loaded = loaded if per_tensor else expand_loaded(param, loaded)     # rows in units of param.row_div
        rdiv, start = getattr(param, "row_div", 1), 0
        for i, size in enumerate(sections):
            part = loaded if len(sections) == 1 or per_tensor else loaded.narrow(0, start // rdiv, size // rdiv)
            self.load_rows(param, part, first + i)
            start += size


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE_RANK, quant=None):
        # quant: checkpoint projection names -> the quantized format of their fused layer (or None)
        super().__init__()
        quant = quant or (lambda parts: None)
        self.tp = tp
        self.num_k_heads = tp.shard(cfg.linear_num_key_heads, "linear_num_key_heads")
        self.num_v_heads = tp.shard(cfg.linear_num_value_heads, "linear_num_value_heads")
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel_dim
        key_dim, value_dim = cfg.linear_num_key_heads * self.head_k_dim, cfg.linear_num_value_heads * self.head_v_dim
        self.sections = [key_dim, key_dim, value_dim]                       # global q, k, v channels
        self.conv_channels = sum(self.sections) // tp.size
        h = cfg.hidden_size
        hv = cfg.linear_num_value_heads
        # One input projection: q k v z, and b a where they share its format. The b and a rows alone (2 Hv)
        # made a GEMV of a few programs per layer at decode, one launch in five of a linear layer's.
        # Checkpoints that keep in_proj_b/a unquantized beside quantized in_proj_qkv/z get two layers.
        fmt, ba_fmt = quant(["in_proj_qkv", "in_proj_z"]), quant(["in_proj_b", "in_proj_a"])
        parts = {"qkv": self.sections, "z": [value_dim]}
        self.in_proj_ba = None
        if ba_fmt == fmt:
            parts.update(b=[hv], a=[hv])
        else:
            self.in_proj_ba = GatedDeltaInProj(h, {"b": [hv], "a": [hv]}, tp, ba_fmt)
        self.in_proj = GatedDeltaInProj(h, parts, tp, fmt)
        # this rank's columns of the projections' output: mixed q k v, z, b, a
        self._split = [self.conv_channels, self.num_v_heads * self.head_v_dim, self.num_v_heads, self.num_v_heads]
        self.conv_weight = nn.Parameter(torch.empty(self.conv_channels, self.kernel), requires_grad=False)
        self.conv_weight.weight_loader = self._load_qkv
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        for p in (self.A_log, self.dt_bias):
            p.weight_loader = self._load_heads
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = RowParallelLinear(value_dim, h, tp, quant(["out_proj"]))
        self.state = None                    # engine.worker.state_pool.LayerState, bound by the runner
        self._pending = None                 # a verify pass's inputs, until `commit`

    def _load_qkv(self, param, loaded, shard_id=None) -> None:
        load_sections(param, loaded, self.sections, self.tp)

    def _load_heads(self, param, loaded, shard_id=None) -> None:
        n = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        ctx = get_forward_context()
        if self.in_proj_ba is None:
            mixed, z, b, a = self.in_proj(x).split(self._split, dim=-1)      # mixed: [T, C]; b, a: [T, Hv]
        else:
            mixed, z = self.in_proj(x).split(self._split[:2], dim=-1)
            b, a = self.in_proj_ba(x).split(self._split[2:], dim=-1)
        z = z.view(-1, self.num_v_heads, self.head_v_dim)
        n = ctx.uniform_query_len
        if n is not None and x.is_cuda and n <= RECURRENT_MAX_TOKENS and self._fused_step_fits():
            o = self._step(mixed.view(-1, n, mixed.shape[-1]), a.view(-1, n, a.shape[-1]), b.view(-1, n, b.shape[-1]),
                           ctx.state_slots, ctx.defer_state_commit)
            return self.out_proj(self.norm(o.flatten(0, 1), z).flatten(1))
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if ctx.uniform_query_len is not None:
            n = ctx.uniform_query_len
            o = self._run(mixed.view(-1, n, mixed.shape[-1]), beta.view(-1, n, beta.shape[-1]),
                          g.view(-1, n, g.shape[-1]), ctx.state_slots, ctx.defer_state_commit)
            o = o.flatten(0, 1)
        else:                           # a packed prefill: each prompt's piece from its own slot
            outs, start = [], 0
            lens = ctx.host_query_lens if ctx.host_query_lens is not None else ctx.host_lens()[0]
            for i, n in enumerate(lens):
                if n:
                    sl = slice(start, start + n)
                    outs.append(self._run(mixed[None, sl], beta[None, sl], g[None, sl],
                                          ctx.state_slots[i:i + 1], False)[0])
                start += n
            o = torch.cat(outs)
        o = self.norm(o.to(x.dtype), z)                                        # [T, Hv, dv]
        return self.out_proj(o.flatten(1))

    def _run(self, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, slots: torch.Tensor,
             defer: bool) -> torch.Tensor:
        # mixed: [B, n, C]; beta, g: [B, n, Hv]; slots: [B] -> o [B, n, Hv, dv] (float32)
        bsz, n, _ = mixed.shape
        window = self.state.conv[slots]                                        # [B, C, kernel-1]
        extended = torch.cat([window, mixed.transpose(1, 2).to(window.dtype)], dim=-1)
        conv = F.conv1d(extended.to(self.conv_weight.dtype), self.conv_weight.unsqueeze(1),
                        groups=self.conv_channels)                             # [B, C, n]
        qkv = F.silu(conv).transpose(1, 2).to(mixed.dtype)
        q, k, v = qkv.split([s // self.tp.size for s in self.sections], dim=-1)
        q, k = (self._heads(t) for t in (q, k))
        q = q * self.head_k_dim ** -0.5
        v = v.reshape(bsz, n, self.num_v_heads, self.head_v_dim)
        s0 = self.state.ssm[slots]
        kernels = _kernels(mixed.device)
        if defer:
            o, _ = kernels.recurrent(q, k, v, g, beta, s0)
            self._pending = ("general", slots, extended, q, k, v, g, beta)
            return o
        step = kernels.recurrent if n <= RECURRENT_MAX_TOKENS else kernels.chunked
        o, s = step(q, k, v, g, beta, s0)
        self.state.ssm[slots] = s
        self.state.conv[slots] = extended[..., n:]
        return o

    def _fused_step_fits(self) -> bool:
        from engine.kernels.gated_delta import decode_step as gated_delta_step
        return self.kernel == gated_delta_step.CONV_WIDTH

    def _step(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
              defer: bool) -> torch.Tensor:
        # CUDA, runs of n <= RECURRENT_MAX_TOKENS: mixed [B, n, C]; a, b [B, n, Hv] -> o [B, n, Hv, dv] float32,
        # the slot's window and state updated in place (a verify pass: neither, until `commit`)
        from engine.kernels.gated_delta import decode_step as gated_delta_step
        q, k, v = gated_delta_step.conv_qkv(mixed, self.state.conv, self.conv_weight, slots, self.num_k_heads,
                                            self.head_k_dim, self.head_v_dim, write_window=not defer)
        o = gated_delta_step.recurrent(q, k, v, a, b, self.A_log, self.dt_bias, self.state.ssm, slots,
                                       write_state=not defer)
        if defer:
            self._pending = ("step", slots, mixed, q, k, v, a, b)
        return o

    def _commit_step(self, num_kept: torch.Tensor) -> None:
        from engine.kernels.gated_delta import decode_step as gated_delta_step
        _, slots, mixed, q, k, v, a, b = self._pending
        self._pending = None
        # the window first: it still holds the state before the verified tokens
        extended = torch.cat([self.state.conv[slots], mixed.transpose(1, 2).to(self.state.conv.dtype)], dim=-1)
        gated_delta_step.recurrent(q, k, v, a, b, self.A_log, self.dt_bias, self.state.ssm, slots,
                                   num_kept=num_kept, store_output=False)
        self._commit_window(slots, extended, num_kept)

    def _commit_window(self, slots: torch.Tensor, extended: torch.Tensor, num_kept: torch.Tensor) -> None:
        # the window after m tokens: inputs m .. m+kernel-2 of [old window, the n new inputs]
        idx = num_kept.view(-1, 1, 1) + torch.arange(self.kernel - 1, device=num_kept.device)
        self.state.conv[slots] = extended.gather(2, idx.expand(-1, extended.shape[1], -1))

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        # [B, n, Hk * dk] -> L2-normalised [B, n, Hk, dk] float32 (each serves Hv / Hk value heads)
        t = t.float().reshape(*t.shape[:2], self.num_k_heads, self.head_k_dim)
        return t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6)

    def commit(self, num_kept: torch.Tensor) -> None:
        """After a verify pass: the state after each row's first num_kept [B] tokens (>= 1) becomes its slot's."""
        if self._pending[0] == "step":
            return self._commit_step(num_kept)
        _, slots, extended, q, k, v, g, beta = self._pending
        self._pending = None
        n = q.shape[1]
        keep = (torch.arange(n, device=num_kept.device).unsqueeze(0) < num_kept.unsqueeze(1)).unsqueeze(-1)
        _, s = _kernels(q.device).recurrent(q, k, v, g * keep, beta * keep, self.state.ssm[slots])
        self.state.ssm[slots] = s
        self._commit_window(slots, extended, num_kept)


def _kernels(device: torch.device):
    """The gated delta rule for a device: fla-core's Triton kernels on CUDA, the torch reference elsewhere."""
    if device.type == "cuda":
        from engine.kernels.gated_delta import fla as gated_delta_fla
        return gated_delta_fla
    return gated_delta_ref
