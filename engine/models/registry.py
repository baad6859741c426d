"""Which model class serves a `ModelConfig`: Qwen3, Qwen3-MoE, a Qwen3.5-class hybrid, Qwen3.5-MoE or Qwen3-Next."""

from __future__ import annotations

from engine.config import ModelConfig


def model_class(cfg: ModelConfig):
    if cfg.model_type == "qwen3_next":
        from engine.models.qwen3_next import Qwen3NextForCausalLM
        return Qwen3NextForCausalLM
    if cfg.is_hybrid and cfg.is_moe:
        from engine.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
        return Qwen3_5MoeForCausalLM
    if cfg.is_hybrid:
        from engine.models.qwen3_5 import Qwen3_5ForCausalLM
        return Qwen3_5ForCausalLM
    if cfg.is_moe:
        from engine.models.qwen3_moe import Qwen3MoeForCausalLM
        return Qwen3MoeForCausalLM
    from engine.models.qwen3 import Qwen3ForCausalLM
    return Qwen3ForCausalLM
