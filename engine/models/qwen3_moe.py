"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 (engine.models.qwen3) with the MLP of its sparse
layers a mixture of experts (engine.layers.moe: softmax top-k router, no shared expert). Which
layers are sparse is `ModelConfig.layer_is_moe` (decoder_sparse_step, mlp_only_layers); the MTP
layer, where a checkpoint has one, is sparse too.

The experts load from per-expert tensors or from fused `gate_up_proj` / `down_proj` stacks
(engine.layers.moe_experts); every other tensor is Qwen3's."""

from __future__ import annotations

from engine.layers.moe_experts import expert_param_name
from engine.models.qwen3 import Qwen3ForCausalLM


class ExpertWeights:
    """Mixin of the MoE models: the experts' checkpoint tensors load into their stacked parameters."""

    def fused_name(self, name: str) -> tuple[str, object]:
        hit = expert_param_name(name)
        return hit if hit is not None else super().fused_name(name)


class Qwen3MoeForCausalLM(ExpertWeights, Qwen3ForCausalLM):
    """Qwen3ForCausalLM's interface; the sparse layers are chosen by the config (Qwen3DecoderLayer `sparse`)."""
