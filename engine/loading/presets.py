"""Reference shapes (docs/performance.md) that the benchmark builds with random weights: `model="preset:NAME"`."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.loading.embedded_model import DEFAULT_CONFIG

QWEN3_EOS = (151645, 151643)

PRESETS: dict[str, ModelConfig] = {
    "qwen3-8b": ModelConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0,
        max_position_embeddings=262144, tie_word_embeddings=False, mtp_num_hidden_layers=1,
        eos_token_ids=QWEN3_EOS),
    "qwen3-32b": ModelConfig(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0,
        max_position_embeddings=262144, tie_word_embeddings=False, mtp_num_hidden_layers=1,
        eos_token_ids=QWEN3_EOS),
    # Qwen3.5-27B's language model (its config.json text_config): 48 Gated DeltaNet layers (16 key
    # heads, 48 value heads, dk = dv = 128, conv 4) and 16 gated full-attention layers (24 heads, 4 KV
    # heads of 256, RoPE on 25 % of each head), 3 : 1; one MTP layer.
    "qwen3.5-27b": ModelConfig(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, rope_theta=10_000_000.0,
        max_position_embeddings=262144, tie_word_embeddings=False, mtp_num_hidden_layers=1,
        model_type="qwen3_5_text",
        layer_types=("linear_attention", "linear_attention", "linear_attention", "full_attention") * 16,
        partial_rotary_factor=0.25, attn_output_gate=True, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=48),
    # Qwen3-30B-A3B (its config.json): 48 layers, 128 experts of 768, top 8 renormalised, no shared expert,
    # no MTP layer; 3.3 B of its 30.5 B parameters are read per token (decode batch 1, tools/bench/shapes.py).
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, rope_theta=1_000_000.0,
        max_position_embeddings=262144, tie_word_embeddings=False, eos_token_ids=QWEN3_EOS, model_type="qwen3_moe",
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    # Qwen3.5-35B-A3B's language model: 30 Gated DeltaNet layers (16 key heads, 32 value heads of 128) and 10
    # gated full-attention layers (16 heads, 2 KV heads of 256, RoPE on 25 %), 3 : 1; every MLP 256 experts of
    # 512, top 8, and a gated shared expert of 512; one MTP layer, sparse too.
    "qwen3.5-35b-a3b": ModelConfig(
        vocab_size=248320, hidden_size=2048, intermediate_size=0, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, rope_theta=10_000_000.0,
        max_position_embeddings=262144, tie_word_embeddings=False, mtp_num_hidden_layers=1,
        model_type="qwen3_5_moe_text",
        layer_types=("linear_attention", "linear_attention", "linear_attention", "full_attention") * 10,
        partial_rotary_factor=0.25, attn_output_gate=True, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512),
    "tiny": DEFAULT_CONFIG,
    # a hybrid at the default model's size (its tokenizer's vocabulary): the CPU dry run of the
    # benchmark's hybrid section
    "tiny-hybrid": ModelConfig(
        vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=10_000_000.0,
        max_position_embeddings=4096, tie_word_embeddings=False, mtp_num_hidden_layers=1,
        eos_token_ids=DEFAULT_CONFIG.eos_token_ids, model_type="qwen3_5_text",
        layer_types=("linear_attention", "linear_attention", "linear_attention", "full_attention"),
        partial_rotary_factor=0.25, attn_output_gate=True, linear_conv_kernel_dim=4, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4),
    # mixtures of experts at the default model's size: the CPU dry run of the benchmark's MoE section
    "tiny-moe": ModelConfig(
        vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rope_theta=1_000_000.0, max_position_embeddings=4096,
        tie_word_embeddings=False, eos_token_ids=DEFAULT_CONFIG.eos_token_ids, model_type="qwen3_moe",
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
}

PREFIX = "preset:"


# "preset:qwen3-8b-nvfp4": the shape with every linear layer but lm_head in that format; "-w4a16" is
# compressed-tensors pack-quantized INT4, groups of 128, symmetric (llmcompressor's W4A16 scheme)
QUANT_SUFFIXES = ("-fp8", "-nvfp4", "-w4a16")
W4A16_CONFIG = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                              "weights": {"type": "int", "num_bits": 4, "strategy": "group",
                                                          "group_size": 128, "symmetric": True}}}}


def preset(name: str) -> ModelConfig:
    key = name[len(PREFIX):] if name.startswith(PREFIX) else name
    for suffix in QUANT_SUFFIXES:
        if key.endswith(suffix) and key[:-len(suffix)] in PRESETS:
            return _quantized(PRESETS[key[:-len(suffix)]], suffix[1:])
    if key not in PRESETS:
        from engine.errors import ModelLoadError
        raise ModelLoadError(f"unknown preset {key!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[key]


def _quantized(cfg: ModelConfig, fmt: str) -> ModelConfig:
    from dataclasses import replace

    import torch

    from engine.models.registry import model_class
    from engine.quant.scheme import QuantScheme, from_hf
    with torch.device("meta"):
        shapes = model_class(cfg)(cfg, with_mtp=True).checkpoint_shapes()
    scheme = from_hf(W4A16_CONFIG) if fmt == "w4a16" else QuantScheme(fmt)
    return replace(cfg, quant=scheme.over_linears(shapes))
