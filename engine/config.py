"""Configuration dataclasses, validated once at the edge (constructors), trusted afterwards."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidArgumentError, ModelLoadError

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5", "qwen3_next", "qwen3_5_moe_text",
                         "qwen3_5_moe")
# Hybrid (Gated DeltaNet + gated attention) checkpoints: Qwen3_5ForCausalLM and the language model
# of Qwen3_5ForConditionalGeneration (its `text_config`); see engine/loading/hybrid_config.py. The
# mixture-of-experts ones (Qwen3-Next, Qwen3.5-MoE) add the fields of engine/loading/moe_config.py.
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")
# Models whose MLPs are (mostly) mixtures of experts: engine/loading/moe_config.py, docs/moe.md.
MOE_MODEL_TYPES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")
DTYPES = ("float32", "bfloat16", "float16")


KV_ROLES = ("both", "producer", "consumer")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Qwen3-family checkpoint (Hugging Face `config.json` fields)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    # Number of MTP (multi-token prediction) layers the checkpoint declares; 0 = none.
    mtp_num_hidden_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "qwen3"
    # FP8-block or NVFP4 linear layers (engine.quant.scheme.QuantScheme); None = the model dtype
    quant: Any = None
    # Hybrid models only (Qwen3.5 class). `layer_types` empty = every layer full attention (Qwen3).
    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 1.0      # share of each head's dims that RoPE rotates
    attn_output_gate: bool = False          # q_proj also emits a sigmoid gate per head
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    # Mixtures of experts only (engine/loading/moe_config.py). `num_experts` 0 = every MLP dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0    # 0 = no shared expert
    norm_topk_prob: bool = True                 # renormalise the top-k routing weights to sum to one
    decoder_sparse_step: int = 1                # layer i is MoE iff (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()       # ... and i is not listed here

    @property
    def is_hybrid(self) -> bool:
        return bool(self.layer_types)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, i: int) -> bool:
        """Whether main-model layer i has a sparse MoE block (else a dense MLP of intermediate_size)."""
        return self.is_moe and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def full_attention_layers(self) -> list[int]:
        """Indices of the main model's layers that keep paged KV."""
        if not self.layer_types:
            return list(range(self.num_hidden_layers))
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @classmethod
    def from_hf(cls, hf: dict[str, Any], eos_token_ids: tuple[int, ...] = ()) -> "ModelConfig":
        model_type = hf.get("model_type")
        if model_type in HYBRID_MODEL_TYPES:
            from engine.loading.hybrid_config import hybrid_config_from_hf
            return hybrid_config_from_hf(cls, hf, eos_token_ids)
        if model_type == "qwen3_moe":
            from engine.loading.moe_config import moe_config_from_hf
            return moe_config_from_hf(cls, hf, eos_token_ids)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if k not in hf]
        if missing:
            raise ModelLoadError(f"config.json lacks {', '.join(missing)}")
        heads = int(hf["num_attention_heads"])
        # transformers 5 writes RoPE settings under `rope_parameters` (older configs: top-level
        # `rope_theta`, optional `rope_scaling`); only the default (unscaled) RoPE is implemented.
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelLoadError(f"unsupported rope_type {rope_type!r}; supported: default")
        if not eos_token_ids:
            eos = hf.get("eos_token_id")
            eos_token_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 1_000_000.0))),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 40960)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            mtp_num_hidden_layers=int(hf.get("mtp_num_hidden_layers", 0) or 0),
            eos_token_ids=tuple(int(e) for e in eos_token_ids),
            model_type=model_type,
            quant=_quant_scheme(hf.get("quantization_config")),
        )

    def num_params(self, include_mtp: bool = True, active: bool = False) -> int:
        """Parameters of the model (embedding and lm_head included). `active`: those one token uses --
        a mixture of experts counts its router, shared expert and `num_experts_per_tok` routed experts."""
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        dense_mlp = 3 * h * f
        if self.is_moe:
            from engine.loading.moe_config import moe_mlp_params
            sparse_mlp = moe_mlp_params(self, active)
        mlp = [sparse_mlp if self.layer_is_moe(i) else dense_mlp for i in range(self.num_hidden_layers)]
        mtp_mlp = sparse_mlp if self.is_moe else dense_mlp          # the MTP layer is MoE where the model is
        full = h * (q + 2 * kv) + q * h + 2 * h + 2 * d              # attention and the two layer norms
        if self.is_hybrid:
            from engine.loading.hybrid_config import hybrid_layer_params
            full, linear = hybrid_layer_params(self)
            mixers = [full if t == "full_attention" else linear for t in self.layer_types]
        else:
            mixers = [full] * self.num_hidden_layers
        n = sum(mixers) + sum(mlp) + self.vocab_size * h + h
        if not self.tie_word_embeddings:
            n += self.vocab_size * h
        if include_mtp:
            n += self.mtp_num_hidden_layers * (full + mtp_mlp + 2 * h * h + 3 * h)
        return n


@dataclass
class EngineConfig:
    """Everything the engine needs besides the weights. Field names follow vLLM's flags."""

    model: str | None = None                # HF directory; None = the embedded default model
    served_model_name: str | None = None    # the name clients see and ask for; None = the model directory's name
    device: str = "auto"                    # "auto" (CUDA when present, else CPU), "cpu" or "cuda[:N]"
    dtype: str = "auto"                     # "auto" = bfloat16 on CUDA (float16 below sm80), float32 on CPU
    kv_dtype: str = "auto"                  # "auto" = dtype; "int8" = per token-and-head scales
    block_size: int = 16                    # tokens per KV page
    prefill_chunk: int = 2048               # tokens per prefill step of the one prefill lane
    kv_capacity: int | None = None          # tokens of KV; None = derived from free memory
    memory_utilization: float = 0.90        # share of device memory the engine may take
    draft_tokens: int = 0                   # MTP draft tokens per round (k); 0 = no speculation
    adaptive_draft: bool = False            # pick each round's k in [0, draft_tokens] (engine.sched.draft_policy)
    max_batch: int = 64                     # running requests in the decode batch
    max_pending: int = 256                  # queued requests before new ones are refused
    pending_timeout_ms: int = 60_000        # a request queued longer fails with a queue timeout
    prefix_reuse: bool = True               # share full KV blocks of identical prefixes
    state_snapshots: int = 16               # hybrids: linear-attention states kept for prefix reuse
    max_model_len: int | None = None        # context limit; None = the model's
    tensor_parallel_size: int = 1
    tp_comm: str = "auto"                   # TP all-reduce: "p2p" (one-shot NVLink), "nccl", "auto"
    enforce_eager: bool = False             # no CUDA graphs
    async_scheduling: bool = True           # plan decode round N+1 while the GPU runs N (engine.worker.async_rounds)
    draft_vocab: int = 0                    # draft over the first N token ids only; 0 = full
    stats_interval_s: float = 1.0           # width of one `history` interval in the snapshot
    lease_seconds: float = 60.0             # how long a prefilled (parked) request keeps its KV for a decode
    handoff_timeout_seconds: float = 5.0    # a parked handle older than this gives its room to a queued request
    seat_timeout_seconds: float = 60.0      # an attached request waits this long for a decode seat at most; 0 = no bound
    # prefill/decode across engines (docs/disaggregation.md): "producer" prefills and lends the prompt's KV,
    # "consumer" pulls it and decodes, "both" (the default) serves whole requests and either leg
    kv_role: str = "both"
    kv_pull_timeout_seconds: float = 30.0   # a consumer's pull of a prompt's KV longer than this fails (UNAVAILABLE)
    quantization: str | None = None         # "fp8" / "ptpc_fp8": an unquantized checkpoint's linears in FP8 at load
    speculative_model: str | None = None    # a checkpoint whose mtp.* head drafts (when the model's has none)
    # vLLM's spelling: {"model": DIR, "num_speculative_tokens": k, "method": "mtp"} sets the two fields above
    speculative_config: dict | None = None

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            self._apply_speculative_config(self.speculative_config)
        if self.device == "auto":
            import torch                    # only here: a config made with an explicit device needs no torch
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise InvalidArgumentError("dtype", f"must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_dtype not in ("auto", "int8", *DTYPES):
            raise InvalidArgumentError("kv_dtype", f"must be auto, int8 or a float dtype, got {self.kv_dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise InvalidArgumentError("device", f"must be cpu or cuda[:N], got {self.device!r}")
        _require_int("block_size", self.block_size, 1, 1024)
        if self.block_size & (self.block_size - 1):
            raise InvalidArgumentError("block_size", f"must be a power of two, got {self.block_size}")
        _require_int("prefill_chunk", self.prefill_chunk, 16, 1 << 20)
        _require_int("draft_tokens", self.draft_tokens, 0, 8)
        if self.adaptive_draft and self.draft_tokens < 1:
            raise InvalidArgumentError("draft_tokens", "adaptive draft length needs a maximum k >= 1")
        _require_int("max_batch", self.max_batch, 1, 4096)
        _require_int("max_pending", self.max_pending, 0, 1 << 20)
        _require_int("pending_timeout_ms", self.pending_timeout_ms, 1, 1 << 40)
        _require_int("tensor_parallel_size", self.tensor_parallel_size, 1, 64)
        _require_int("draft_vocab", self.draft_vocab, 0, 1 << 24)
        _require_int("state_snapshots", self.state_snapshots, 0, 1 << 16)
        if self.tp_comm not in ("auto", "p2p", "nccl"):
            raise InvalidArgumentError("tp_comm", f"must be auto, p2p or nccl, got {self.tp_comm!r}")
        if self.kv_capacity is not None:
            _require_int("kv_capacity", self.kv_capacity, 1, 1 << 40)
        if self.max_model_len is not None:
            _require_int("max_model_len", self.max_model_len, 1, 1 << 40)
        if self.served_model_name is not None and (not isinstance(self.served_model_name, str)
                                                   or not self.served_model_name.strip()):
            raise InvalidArgumentError("served_model_name", f"must be a non-empty name, got {self.served_model_name!r}")
        if not (0.0 < self.memory_utilization <= 1.0):
            raise InvalidArgumentError("memory_utilization", f"must be in (0, 1], got {self.memory_utilization}")
        if not (self.stats_interval_s > 0 and math.isfinite(self.stats_interval_s)):
            raise InvalidArgumentError("stats_interval_s", "must be a positive number")
        _require_seconds("lease_seconds", self.lease_seconds, 86_400)
        _require_seconds("handoff_timeout_seconds", self.handoff_timeout_seconds, 86_400, zero_ok=True)
        _require_seconds("seat_timeout_seconds", self.seat_timeout_seconds, 86_400, zero_ok=True)
        _require_seconds("kv_pull_timeout_seconds", self.kv_pull_timeout_seconds, 3600)
        if self.kv_role not in KV_ROLES:
            raise InvalidArgumentError("kv_role", f"must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_role != "both" and self.tensor_parallel_size != 1:
            raise InvalidArgumentError("kv_role", f"a {self.kv_role} moves one rank's KV pool: it needs "
                                       f"tensor_parallel_size 1, got {self.tensor_parallel_size}")

        if self.quantization is not None and self.quantization not in ("fp8", "ptpc_fp8"):
            raise InvalidArgumentError("quantization", f"must be fp8 or ptpc_fp8, got {self.quantization!r}")
        if self.speculative_model is not None and self.draft_tokens < 1:
            raise InvalidArgumentError("speculative_model", "drafts nothing with num_speculative_tokens 0; "
                                       "set --num-speculative-tokens K (K >= 1)")

    def _apply_speculative_config(self, spec: Any) -> None:
        """vLLM's `speculative_config` (a dict, or its JSON text) as speculative_model and draft_tokens."""
        import json
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise InvalidArgumentError("speculative_config", f"is not valid JSON ({e})") from None
        if not isinstance(spec, dict):
            raise InvalidArgumentError("speculative_config", f"must be a JSON object, got {type(spec).__name__}")
        unknown = sorted(set(spec) - {"model", "num_speculative_tokens", "method"})
        if unknown:
            raise InvalidArgumentError(f"speculative_config.{unknown[0]}", "is not supported; supported: model, "
                                       "num_speculative_tokens, method")
        if spec.get("method", "mtp") != "mtp":
            raise InvalidArgumentError("speculative_config.method", f"must be mtp (the model's MTP head), "
                                       f"got {spec['method']!r}")
        k = spec.get("num_speculative_tokens")
        if k is not None:
            if self.draft_tokens not in (0, k):
                raise InvalidArgumentError("speculative_config.num_speculative_tokens",
                                           f"{k} differs from num_speculative_tokens {self.draft_tokens}")
            self.draft_tokens = k
        model = spec.get("model")
        if model is not None:
            if self.speculative_model not in (None, model):
                raise InvalidArgumentError("speculative_config.model",
                                           f"{model!r} differs from speculative_model {self.speculative_model!r}")
            self.speculative_model = str(model)
        self.speculative_config = None                      # applied

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"

    @property
    def kv_dtype_name(self) -> str:
        return self.torch_dtype_name if self.kv_dtype == "auto" else self.kv_dtype


def _quant_scheme(qc):
    if not qc:
        return None
    from engine.quant.scheme import from_hf
    return from_hf(qc)


def _require_seconds(name: str, value: Any, hi: int, *, zero_ok: bool = False) -> None:
    """A duration: a number in (0, hi] seconds, or [0, hi] with zero_ok (NaN and infinity fail the bounds)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not ((0 <= value if zero_ok else 0 < value) and value <= hi):
        raise InvalidArgumentError(name, f"must be in {'[' if zero_ok else '('}0, {hi}] seconds, got {value!r}")


def _require_int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(name, f"must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise InvalidArgumentError(name, f"must be in [{lo}, {hi}], got {value}")
