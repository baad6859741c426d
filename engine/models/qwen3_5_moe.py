"""Qwen3.5-MoE (Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B): the Qwen3.5 hybrid (engine.models.qwen3_5) with
every MLP -- the MTP layer's included -- a sparse MoE block with a sigmoid-gated shared expert
(engine.layers.moe).

Published checkpoints are `Qwen3_5MoeForConditionalGeneration`s: the language model under
`model.language_model.` (engine.loading.checkpoint renames it), the main layers' experts fused
(`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`) and the MTP layer's per expert;
transformers' `save_pretrained` writes per-expert tensors everywhere. Both load (engine.layers.moe_experts)."""

from __future__ import annotations

from engine.models.qwen3_5 import Qwen3_5ForCausalLM
from engine.models.qwen3_moe import ExpertWeights


class Qwen3_5MoeForCausalLM(ExpertWeights, Qwen3_5ForCausalLM):
    """Qwen3_5ForCausalLM's interface (linear-attention states, verify commits) with MoE MLPs."""
