"""Helpers of the hybrid-model tests: the shared trained hybrid (skipped where absent) and tiny random
Qwen3.5-class checkpoints written by transformers itself (CausalLM and ConditionalGeneration layouts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

SHARED_HYBRID = Path(__file__).resolve().parents[3] / "shared/models/tiny-qwen3_5-mtp"

# A tiny hybrid: [linear x3, full], dk != dv and two value heads per key head so that a transposed
# state or a wrong head grouping shows; 25 % RoPE of head_dim 32 (8 rotary dims).
RANDOM_HYBRID_TEXT = dict(
    vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=24,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"], rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
)
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                   temporal_patch_size=2, spatial_merge_size=1)


def require_shared_hybrid() -> str:
    if not (SHARED_HYBRID / "config.json").is_file():
        pytest.skip(f"the trained hybrid test model is not at {SHARED_HYBRID} (a checkout outside the ninfer "
                    "workplace)")
    return str(SHARED_HYBRID)


def randomize(model, seed: int) -> None:
    """Every weight random (1-D ones around their init scale), so that a misplaced tensor shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                base = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=gen) * fan_in ** -0.5)


def _finish_dir(path: Path) -> None:
    from engine.loading.embedded_model import build_default_tokenizer
    build_default_tokenizer().inner.save(str(path / "tokenizer.json"))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}))


def build_random_hybrid(path: Path, seed: int = 0, **overrides):
    """A random transformers Qwen3_5ForCausalLM saved with safetensors; returns the float32 model."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**RANDOM_HYBRID_TEXT, **overrides})).float().eval()
    randomize(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    _finish_dir(path)
    return model


def build_random_multimodal(path: Path, seed: int = 0):
    """A random transformers Qwen3_5ForConditionalGeneration (vision tower included); returns it."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    torch.manual_seed(seed)
    text = {k: v for k, v in RANDOM_HYBRID_TEXT.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=TINY_VISION)).float().eval()
    randomize(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    _finish_dir(path)
    return model
