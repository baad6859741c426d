"""Which model class serves a `ModelConfig`: Qwen3, or a Qwen3.5-class hybrid."""

from __future__ import annotations

from engine.config import ModelConfig


def model_class(cfg: ModelConfig):
    if cfg.is_hybrid:
        from engine.models.qwen3_5 import Qwen3_5ForCausalLM
        return Qwen3_5ForCausalLM
    from engine.models.qwen3 import Qwen3ForCausalLM
    return Qwen3ForCausalLM
