"""Reading the config of a Qwen3.5-class hybrid checkpoint into a `ModelConfig`.

Two layouts name the same language model:
- `qwen3_5_text` (`Qwen3_5ForCausalLM`): the fields at the top level;
- `qwen3_5` (`Qwen3_5ForConditionalGeneration`): the language model's fields under `text_config`
  (the vision tower's under `vision_config`, which ninfer does not serve), with
  `tie_word_embeddings` and the token ids possibly at the top level.
The mixture-of-experts hybrids read the same way: `qwen3_5_moe_text` flat, `qwen3_5_moe` nested, and
`qwen3_next` flat (older files give `full_attention_interval` instead of `layer_types`, and
`rope_theta` / `partial_rotary_factor` at the top level); their experts' fields go through
engine/loading/moe_config.py.

The fields shared with Qwen3 go through `ModelConfig.from_hf` (one validation of RoPE, EOS, ...);
this module adds the layer pattern and the linear-attention shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.errors import ModelLoadError

MOE_MODEL_TYPES = ("qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")

LINEAR, FULL = "linear_attention", "full_attention"


NESTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
# transformers' defaults where a config leaves the share of each head RoPE turns out
DEFAULT_ROTARY_FACTOR = {"qwen3_next": 0.25, "qwen3_5_moe_text": 0.25, "qwen3_5_moe": 0.25}


def text_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config fields, whichever of the two layouts `hf` is."""
    if hf.get("model_type") not in NESTED_MODEL_TYPES:
        return dict(hf)
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"config.json of model_type {hf.get('model_type')!r} lacks a text_config object")
    merged = dict(text)
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if key not in merged and key in hf:
            merged[key] = hf[key]
    return merged


def layer_pattern(text: dict[str, Any]) -> tuple[str, ...]:
    n = int(text["num_hidden_layers"])
    types = text.get("layer_types")
    if types is None:
        # older configs: every `full_attention_interval`-th layer is full attention
        interval = int(text.get("full_attention_interval", 4))
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    types = tuple(types)
    if len(types) != n:
        raise ModelLoadError(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    bad = sorted({t for t in types if t not in (LINEAR, FULL)})
    if bad:
        raise ModelLoadError(f"layer_types: unsupported layer type(s) {', '.join(bad)}; supported: {LINEAR}, {FULL}")
    return types


def hybrid_config_from_hf(cls, hf: dict[str, Any], eos_token_ids: tuple[int, ...] = ()):
    text = text_fields(hf)
    required = ("linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads")
    missing = [k for k in required + ("num_hidden_layers",) if k not in text]
    if missing:
        raise ModelLoadError(f"config.json lacks {', '.join(missing)} (model_type {hf.get('model_type')!r})")
    model_type = hf["model_type"]
    moe = model_type in MOE_MODEL_TYPES
    if moe:
        from engine.loading.moe_config import with_default_intermediate
        text = with_default_intermediate(text)
    base = cls.from_hf({**text, "model_type": "qwen3"}, eos_token_ids)
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    factor = float(text.get("partial_rotary_factor",
                            rope.get("partial_rotary_factor", DEFAULT_ROTARY_FACTOR.get(model_type, 1.0))))
    rotary_dim = int(base.head_dim * factor)
    if not 0 < rotary_dim <= base.head_dim or rotary_dim % 2:
        raise ModelLoadError(f"partial_rotary_factor={factor} gives an unusable rotary dim {rotary_dim} "
                             f"of head_dim {base.head_dim}")
    hk, hv = int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"])
    if hv % hk:
        raise ModelLoadError(f"linear_num_value_heads={hv} is not a multiple of linear_num_key_heads={hk}")
    cfg = dataclasses.replace(
        base, model_type=model_type, layer_types=layer_pattern(text), partial_rotary_factor=factor,
        attn_output_gate=bool(text.get("attn_output_gate", True)),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        linear_key_head_dim=int(text["linear_key_head_dim"]), linear_value_head_dim=int(text["linear_value_head_dim"]),
        linear_num_key_heads=hk, linear_num_value_heads=hv)
    if not moe:
        return cfg
    from engine.loading.moe_config import check_dense_layers, moe_fields
    # Qwen3-Next checkpoints carry one MTP layer (`mtp.*`) that their config does not declare
    mtp = cfg.mtp_num_hidden_layers or (1 if model_type == "qwen3_next" else 0)
    cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=int(text.get("num_nextn_predict_layers", mtp)),
                              **moe_fields(text, model_type))
    check_dense_layers(cfg)
    return cfg


def linear_state_bytes(cfg, tp: int = 1) -> int:
    """float32 bytes of one request's linear-attention state on one rank: for every linear layer, the
    conv window (kernel - 1 past inputs of the q, k, v channels) and the [value heads, dk, dv] matrix."""
    hk, hv = cfg.linear_num_key_heads // tp, cfg.linear_num_value_heads // tp
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv = (2 * hk * dk + hv * dv) * (cfg.linear_conv_kernel_dim - 1)
    return len(cfg.linear_attention_layers) * (conv + hv * dk * dv) * 4


def state_slot_counts(config, model) -> tuple[int, int]:
    """(seats, snapshots): state slots of running requests (one per batch seat) and of prefix-reuse
    snapshots (engine.cache.state_snapshots), on a hybrid model; (0, 0) otherwise."""
    if not model.is_hybrid:
        return 0, 0
    return config.max_batch, (config.state_snapshots if config.prefix_reuse else 0)


def hybrid_layer_params(cfg) -> tuple[int, int]:
    """Parameters of one gated full-attention layer and of one Gated DeltaNet layer, their two layer
    norms included and their MLP not (a dense one or a mixture of experts: `ModelConfig.num_params`)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    common = 2 * h
    full = h * (2 * q + 2 * kv) + q * h + 2 * d + common
    key, value = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
    conv, hv = 2 * key + value, cfg.linear_num_value_heads
    linear = (h * conv + h * value + 2 * h * hv + conv * cfg.linear_conv_kernel_dim + 2 * hv
              + cfg.linear_value_head_dim + value * h + common)
    return full, linear
