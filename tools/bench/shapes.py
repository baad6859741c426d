"""What a shape costs: FLOPs per prefill token and bytes read per decode step.

Everything here is arithmetic on `engine.config.ModelConfig`; no torch, no device.

    prefill FLOPs of P tokens = P x (2 x body params + 4 x layers x heads x head_dim x mean causal
                                context) + 2 x vocab x hidden (the lm_head, for the last token only)
                              (body params: all but the embedding table and the lm_head, which a
                              prompt's tokens do not run through; a mixture of experts counts the
                              experts one token uses)
    decode bytes per step   = weight bytes read (every matrix but the embedding table, which is
                              only gathered; lm_head included) + KV bytes at the context (the
                              full-attention layers') + on a hybrid, the linear-attention state read
                              and written once (float32 conv windows and recurrent matrices)
    decode floor            = bytes per step / measured copy bandwidth

A mixture of experts reads, per token, its router, its shared expert and the `num_experts_per_tok`
experts the token chose, not all of them: "active params" (`ModelConfig.num_params(active=True)`)
replace the params in the body's FLOPs, and the weight bytes of a batch-1 decode step are those of the experts
actually read. A batch of B tokens reads the union of their choices: under uniform routing the expected
number of distinct experts per layer is E (1 - (1 - k/E)^B) (`experts_read`).
"""

from __future__ import annotations

from engine.config import ModelConfig
from engine.loading.presets import preset

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
INT8_SCALE_BYTES = 4          # one float32 scale per (token, KV head) for K and for V


def model_config(shape: str) -> ModelConfig:
    """A reference shape by preset name ("qwen3-8b", "qwen3-32b", "tiny")."""
    return preset(shape)


def params(cfg: ModelConfig) -> int:
    """Parameters of the main model (no MTP layer), embedding and lm_head included."""
    return cfg.num_params(include_mtp=False)


def active_params(cfg: ModelConfig) -> int:
    """Parameters one token uses (main model): all of a dense model's; a mixture of experts' router, shared
    expert and chosen experts."""
    return cfg.num_params(include_mtp=False, active=True)


def experts_read(cfg: ModelConfig, batch: int = 1) -> float:
    """Expected distinct experts a decode step of `batch` tokens reads per MoE layer (uniform routing)."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** batch) if e else 0.0


def weight_bytes_per_step(cfg: ModelConfig, dtype: str = "bfloat16", tp: int = 1, batch: int = 1) -> int:
    """Weight bytes one rank reads in a k=0 decode step of `batch` tokens: all but the embedding table (a
    gather of one row), lm_head included; with tied embeddings the table *is* the lm_head and is read whole.
    A mixture of experts: the experts the batch chose (all k of one token at batch 1), not all of them."""
    n = params(cfg)
    if cfg.is_moe:
        per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        sparse_layers = sum(cfg.layer_is_moe(i) for i in range(cfg.num_hidden_layers))
        n -= round(sparse_layers * (cfg.num_experts - experts_read(cfg, batch)) * per_expert)
    if not cfg.tie_word_embeddings:
        n -= cfg.vocab_size * cfg.hidden_size
    return n * DTYPE_BYTES[dtype] // tp


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str = "bfloat16", tp: int = 1, mtp: bool = False) -> int:
    """KV bytes one rank holds per token (int8 pages carry a float32 scale per token and KV head)."""
    layers = len(cfg.full_attention_layers) + (cfg.mtp_num_hidden_layers if mtp else 0)
    heads = max(1, cfg.num_key_value_heads // tp)
    per = layers * 2 * heads * cfg.head_dim * DTYPE_BYTES[kv_dtype]
    if kv_dtype == "int8":
        per += layers * 2 * heads * INT8_SCALE_BYTES
    return per


def state_bytes_per_step(cfg: ModelConfig, tp: int = 1) -> int:
    """Linear-attention state bytes one rank moves per decode step of one sequence: read and written
    once (0 for a model with no linear-attention layers)."""
    if not cfg.is_hybrid:
        return 0
    from engine.loading.hybrid_config import linear_state_bytes
    return 2 * linear_state_bytes(cfg, tp)


def decode_bytes_per_step(cfg: ModelConfig, context: float, dtype: str = "bfloat16", kv_dtype: str = "bfloat16",
                          tp: int = 1) -> float:
    """Bytes one rank reads for one k=0 decode step of one sequence at `context` tokens."""
    return (weight_bytes_per_step(cfg, dtype, tp) + context * kv_bytes_per_token(cfg, kv_dtype, tp)
            + state_bytes_per_step(cfg, tp))


def decode_floor_ms(cfg: ModelConfig, context: float, bandwidth_Bps: float, dtype: str = "bfloat16",
                    kv_dtype: str = "bfloat16", tp: int = 1) -> float:
    """The memory-roofline time of one k=0 batch-1 decode step (ranks read their shares in parallel)."""
    return decode_bytes_per_step(cfg, context, dtype, kv_dtype, tp) / bandwidth_Bps * 1e3


def mean_causal_context(prompt_tokens: int) -> float:
    """Token t of a causal prompt attends to t + 1 keys: the mean over the prompt is (P + 1) / 2."""
    return (prompt_tokens + 1) / 2


def embedding_and_head_params(cfg: ModelConfig) -> int:
    """The embedding table and the lm_head: one matrix when they are tied."""
    n = cfg.vocab_size * cfg.hidden_size
    return n if cfg.tie_word_embeddings else 2 * n


def body_params(cfg: ModelConfig) -> int:
    """The parameters every prompt token runs through: all but the embedding table (a gather) and the
    lm_head (run for the last token only); of a mixture of experts, the experts one token uses."""
    return active_params(cfg) - embedding_and_head_params(cfg)


def attention_flops_per_token(cfg: ModelConfig, prompt_tokens: int) -> float:
    """Scores and the weighted sum of the full-attention layers at the prompt's mean causal context."""
    return 4 * len(cfg.full_attention_layers) * cfg.num_attention_heads * cfg.head_dim * mean_causal_context(prompt_tokens)


def prefill_flops(cfg: ModelConfig, prompt_tokens: int) -> float:
    """Model FLOPs of one prefill of `prompt_tokens`: the body and attention for every token, the
    lm_head once (the logits of the last position, which both the engine and its peer compute)."""
    per_token = 2 * body_params(cfg) + attention_flops_per_token(cfg, prompt_tokens)
    return prompt_tokens * per_token + 2 * cfg.vocab_size * cfg.hidden_size


def prefill_flops_per_token(cfg: ModelConfig, prompt_tokens: int) -> float:
    return prefill_flops(cfg, prompt_tokens) / prompt_tokens


def mfu(cfg: ModelConfig, prompt_tokens: int, tok_s: float, matmul_flops: float) -> float:
    """Model FLOPs utilisation of a prefill at `tok_s` against the measured matmul rate."""
    return prefill_flops_per_token(cfg, prompt_tokens) * tok_s / matmul_flops


def describe(cfg: ModelConfig, dtype: str = "bfloat16") -> dict:
    """The shape's numbers the report quotes."""
    return {
        "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "ffn": cfg.intermediate_size,
        "vocab": cfg.vocab_size, "tied_embeddings": cfg.tie_word_embeddings,
        "mtp_layers": cfg.mtp_num_hidden_layers, "params": params(cfg), "active_params": active_params(cfg),
        "body_params": body_params(cfg), "experts": cfg.num_experts, "experts_per_token": cfg.num_experts_per_tok,
        "params_with_mtp": cfg.num_params(include_mtp=True),
        "weight_bytes_per_decode_step": weight_bytes_per_step(cfg, dtype),
        "kv_bytes_per_token": {kv: kv_bytes_per_token(cfg, kv) for kv in (dtype, "int8")},
        "full_attention_layers": len(cfg.full_attention_layers), "state_bytes_per_step": state_bytes_per_step(cfg),
    }
