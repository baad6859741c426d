"""Reading the mixture-of-experts fields of a Qwen MoE config into a `ModelConfig`.

Three architectures (docs/moe.md):
- `qwen3_moe` (Qwen3-30B-A3B, -235B-A22B): Qwen3 with sparse MoE MLPs, no shared expert;
- `qwen3_next` (Qwen3-Next-80B-A3B): a Gated DeltaNet hybrid whose MLPs are sparse MoE blocks with a
  sigmoid-gated shared expert (read by engine/loading/hybrid_config.py, which calls `moe_fields`);
- `qwen3_5_moe` / `qwen3_5_moe_text` (Qwen3.5-35B-A3B, ...): the same, every layer MoE, the router
  always renormalising its top k.

Spellings accepted, as producers write them: `num_experts` (published) or `num_local_experts`
(transformers 5 writes that for qwen3_moe); `norm_topk_prob` (transformers' default is false for
qwen3_moe, true for qwen3_next; qwen3_5_moe has no such field and always renormalises);
`decoder_sparse_step` and `mlp_only_layers` (layer i is MoE iff i is not listed and (i + 1) % step == 0;
qwen3_5_moe has neither: every layer is MoE).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.errors import ModelLoadError

# model types whose router renormalises whatever the config says, and that have no dense layers
ALWAYS_SPARSE = ("qwen3_5_moe_text", "qwen3_5_moe")
SHARED_EXPERT_TYPES = ("qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")


def _int(text: dict[str, Any], key: str, model_type: str, minimum: int = 1) -> int:
    value = text.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelLoadError(f"config.json {key}={value!r}: a mixture of experts ({model_type}) needs an integer "
                             f">= {minimum}")
    return value


def moe_fields(text: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The ModelConfig fields of the mixture of experts described by `text` (the language model's config)."""
    if "num_experts" not in text and "num_local_experts" in text:
        text = {**text, "num_experts": text["num_local_experts"]}
    experts = _int(text, "num_experts", model_type)
    top_k = _int(text, "num_experts_per_tok", model_type)
    if top_k > experts:
        raise ModelLoadError(f"config.json num_experts_per_tok={top_k} exceeds num_experts={experts}")
    fields: dict[str, Any] = dict(num_experts=experts, num_experts_per_tok=top_k,
                                  moe_intermediate_size=_int(text, "moe_intermediate_size", model_type))
    if model_type in SHARED_EXPERT_TYPES:
        fields["shared_expert_intermediate_size"] = _int(text, "shared_expert_intermediate_size", model_type)
    if model_type in ALWAYS_SPARSE:
        return {**fields, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": ()}
    step = text.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ModelLoadError(f"config.json decoder_sparse_step={step!r}: needs an integer >= 1")
    only = text.get("mlp_only_layers") or []
    n = int(text["num_hidden_layers"])
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n
                                         for i in only):
        raise ModelLoadError(f"config.json mlp_only_layers={only!r}: needs layer indices in [0, {n})")
    default_norm = model_type != "qwen3_moe"                # transformers' defaults
    return {**fields, "norm_topk_prob": bool(text.get("norm_topk_prob", default_norm)),
            "decoder_sparse_step": step, "mlp_only_layers": tuple(sorted(set(only)))}


def check_dense_layers(cfg) -> None:
    """A layer that the sparse pattern leaves dense needs the config's intermediate_size."""
    dense = [i for i in range(cfg.num_hidden_layers) if not cfg.layer_is_moe(i)]
    if dense and cfg.intermediate_size < 1:
        raise ModelLoadError(f"layers {dense} have dense MLPs (decoder_sparse_step={cfg.decoder_sparse_step}, "
                             f"mlp_only_layers={list(cfg.mlp_only_layers)}) but intermediate_size is "
                             f"{cfg.intermediate_size}")


def with_default_intermediate(text: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5-MoE configs have no intermediate_size (no dense MLP): 0 for the shared validation."""
    return text if "intermediate_size" in text else {**text, "intermediate_size": 0}


def moe_config_from_hf(cls, hf: dict[str, Any], eos_token_ids: tuple[int, ...] = ()):
    """A `qwen3_moe` config: Qwen3's fields (`ModelConfig.from_hf`) plus the experts'."""
    base = cls.from_hf({**with_default_intermediate(hf), "model_type": "qwen3"}, eos_token_ids)
    cfg = dataclasses.replace(base, model_type="qwen3_moe", **moe_fields(hf, "qwen3_moe"))
    check_dense_layers(cfg)
    return cfg


def moe_mlp_params(cfg, active: bool = False) -> int:
    """Parameters of one sparse MoE block: router, routed experts (all of them, or the `num_experts_per_tok`
    one token uses when `active`), and the shared expert with its gate where the model has one."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    experts = cfg.num_experts_per_tok if active else cfg.num_experts
    n = cfg.num_experts * h + experts * 3 * h * i
    if cfg.shared_expert_intermediate_size:
        n += 3 * h * cfg.shared_expert_intermediate_size + h
    return n


def moe_activation_bytes(cfg, tokens: int, tp: int, elt: int) -> int:
    """Live tensors of one MoE block at `tokens` rows on one rank, besides the layer's own: the router's
    logits and choices, the sort's buffers, the gate/up GEMM's SwiGLU output and the down GEMM's rows (one per
    (token, choice)), and the shared expert's gate/up output."""
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    i, s = cfg.moe_intermediate_size // tp, cfg.shared_expert_intermediate_size // tp
    routing = tokens * (e * 4 + k * 8) + (tokens * k + e * 64) * 4 * 2
    return routing + tokens * (k * (i + cfg.hidden_size) + 3 * s + cfg.hidden_size) * elt
