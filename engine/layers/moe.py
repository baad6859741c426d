"""The sparse MoE block of Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE (docs/moe.md).

    logits   = gate(x)                                    [T, E] in the model dtype (router, replicated)
    ids, w   = top_k(softmax(logits.float()))             renormalised when norm_topk_prob
    routed   = sum_j w[:, j] * expert_{ids[:, j]}(x)      SwiGLU experts (engine.layers.moe_experts)
    out      = routed + sigmoid(shared_expert_gate(x)) * shared_expert(x)     (Qwen3-Next, Qwen3.5-MoE)

Under tensor parallelism every rank routes the same way and computes its slice of each chosen expert
and of the shared expert; `out` is then a partial sum that the decoder layer reduces once, fused with
the residual add and the next norm (`reduce` False, set by engine.layers.reduce_add_norm.defer_reduce).
The shared expert's gate reads the whole x and is replicated, so g * partial sums to g * shared.

On the CPU every step is plain torch (engine.kernels.moe.reference); on CUDA the routing, the
expert-sorted grouped GEMMs and the weighted combine run as Triton kernels (engine.kernels.moe.fused_moe)
where engine/platform.py selects them for the device (else the torch reference, as on the CPU).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.distributed.tp_group import SINGLE_RANK, TPGroup
from engine.layers import moe_experts
from engine.layers.linear import ReplicatedLinear, quant_format
from engine.layers.mlp import Qwen3MLP
from engine.platform import moe_family, paths_for


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE_RANK, prefix: str = ""):
        super().__init__()
        h = cfg.hidden_size
        self.tp = tp
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = ReplicatedLinear(h, cfg.num_experts, tp, quant_format(cfg, prefix, ["gate"]))
        self.experts = moe_experts.FusedExperts(
            cfg.num_experts, h, cfg.moe_intermediate_size, tp,
            moe_experts.experts_format(cfg.quant, f"{prefix}.experts", cfg.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = Qwen3MLP(cfg, tp, f"{prefix}.shared_expert", cfg.shared_expert_intermediate_size)
            self.shared_expert.down_proj.reduce = False          # summed with the routed part, reduced once
            self.shared_expert_gate = ReplicatedLinear(h, 1, tp, quant_format(cfg, prefix, ["shared_expert_gate"]))
        self.reduce = True

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # logits: [T, E] -> ids int32 [T, k], weights float32 [T, k] (the CPU path's routing)
        from engine.kernels.moe import reference
        return reference.route(logits, self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] (the post-attention norm's output) -> [T, hidden] (this rank's partial if not reduce)
        logits = self.gate(x)
        shared = shared_gate = None
        if self.shared_expert is not None:
            shared, shared_gate = self.shared_expert(x).to(x.dtype), self.shared_expert_gate(x)     # [T, H], [T, 1]
        if x.is_cuda and moe_family(paths_for(x.device), self.experts.quant).startswith("triton"):
            from engine.kernels.moe import fused_moe
            out = fused_moe.sparse_moe(x, logits, self.experts, self.top_k, self.renormalize, shared, shared_gate)
        else:
            from engine.kernels.moe import reference
            ids, weights = self.route(logits)
            out = reference.experts(x, ids, weights, self.experts.expert_weights, shared, shared_gate)
        return self.tp.all_reduce(out) if self.reduce else out

    @staticmethod
    def checkpoint_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        """The unquantized tensors of a block at `prefix` (`...mlp`), the experts per expert."""
        h, e = cfg.hidden_size, cfg.num_experts
        shapes = {f"{prefix}.gate.weight": (e, h),
                  **moe_experts.checkpoint_shapes(f"{prefix}.experts", e, h, cfg.moe_intermediate_size)}
        s = cfg.shared_expert_intermediate_size
        if s:
            shapes.update({f"{prefix}.shared_expert.gate_proj.weight": (s, h),
                           f"{prefix}.shared_expert.up_proj.weight": (s, h),
                           f"{prefix}.shared_expert.down_proj.weight": (h, s),
                           f"{prefix}.shared_expert_gate.weight": (1, h)})
        return shapes


def mlp_checkpoint_shapes(cfg: ModelConfig, prefix: str, sparse: bool) -> dict[str, tuple[int, ...]]:
    """The tensors of the MLP at `prefix` (`...mlp`): a sparse MoE block, or a dense SwiGLU of intermediate_size."""
    if sparse:
        return SparseMoeBlock.checkpoint_shapes(cfg, prefix)
    h, f = cfg.hidden_size, cfg.intermediate_size
    return {f"{prefix}.gate_proj.weight": (f, h), f"{prefix}.up_proj.weight": (f, h), f"{prefix}.down_proj.weight": (h, f)}
