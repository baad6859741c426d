"""Qwen3 and its MTP draft module as plain modules: (input_ids, positions) -> hidden.

Paged-attention metadata reaches the attention layers through the forward context; tensor
parallelism lives in the layers (one all-reduce after attention, one after the MLP).

Attention layers are numbered 0 .. L-1 for the main model and L .. L+M-1 for the MTP layers: the
runner binds KV pages by that index, and all of them share one block table per sequence.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.worker.forward_context import get_forward_context
from engine.layers.attention import PagedAttention
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear, quant_format
from engine.layers.mlp import Qwen3MLP
from engine.layers.moe import SparseMoeBlock, mlp_checkpoint_shapes
from engine.layers.norm import RMSNorm, start_residual
from engine.layers.rotary import RotaryEmbedding
from engine.layers.reduce_add_norm import defer_reduce, reduce_add_norm
from engine.distributed.tp_group import SINGLE_RANK, TPGroup


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TPGroup, prefix: str = ""):
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads, tp,
                                          quant_format(cfg, prefix, ["q_proj", "k_proj", "v_proj"]))
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, tp, quant_format(cfg, prefix, ["o_proj"]))
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.rotary = rotary
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, d ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # positions: [T]; x: [T, hidden] -> [T, hidden]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if x.is_cuda:
            # one kernel: q/k norms, RoPE and the K/V write into the pages
            from engine.kernels.elementwise.norm_rope import qk_norm_rope
            q, _ = qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                self.rotary.cos_sin, positions, kv=self.attn.kv, v=v,
                                slot_mapping=get_forward_context().slot_mapping, return_k=False)
            o = self.attn(q, None, None)
        else:
            q, k = self.rotary(positions, self.q_norm(q), self.k_norm(k))
            o = self.attn(q, k, v)
        return self.o_proj(o.flatten(1))


def make_mlp(cfg: ModelConfig, tp: TPGroup, prefix: str, sparse: bool) -> nn.Module:
    """A layer's MLP: a sparse MoE block (engine.layers.moe) or a dense SwiGLU."""
    return SparseMoeBlock(cfg, tp, prefix) if sparse else Qwen3MLP(cfg, tp, prefix)


def mlp_output(mlp: nn.Module):
    """What closes a layer's MLP and may leave its sum over ranks to reduce_add_norm: the dense MLP's
    row-parallel down_proj, or the MoE block itself."""
    return mlp if isinstance(mlp, SparseMoeBlock) else mlp.down_proj


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TPGroup, prefix: str = "",
                 sparse: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen3Attention(cfg, rotary, tp, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = make_mlp(cfg, tp, f"{prefix}.mlp", sparse)
        self.tp = tp
        defer_reduce(tp, self.self_attn.o_proj, mlp_output(self.mlp))

    def forward(self, positions, x, residual):
        # x, residual: [T, hidden]; residual None on the first layer. Returns the next (x, residual).
        # With TP > 1, x is this rank's partial sum whenever residual is given (engine.layers.reduce_add_norm).
        if residual is None:
            x, residual = self.input_layernorm(x), start_residual(x)
        else:
            x, residual = reduce_add_norm(self.tp, self.input_layernorm, x, residual)
        x = self.self_attn(positions, x)
        x, residual = reduce_add_norm(self.tp, self.post_attention_layernorm, x, residual)
        return self.mlp(x), residual


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TPGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, rotary, tp, f"model.layers.{i}", cfg.layer_is_moe(i))
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] -> final-normed hidden [T, hidden]
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return reduce_add_norm(self.tp, self.norm, x, residual)[0]


class MTPModule(nn.Module):
    """The multi-token-prediction head of `models/tiny-qwen3-mtp/README.md`.

        u_t = fc( concat( pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t) ) )
        g_t = norm( layers[0](u_t) )        # RoPE position t, causal over the MTP layer's own KV

    `h_t` is the target's final-normed hidden state at t (or the previous draft step's `g`), and
    `lm_head(g_t)` drafts x_{t+2}. Embedding and lm_head are the main model's.
    """

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TPGroup):
        super().__init__()
        h = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.fc = ReplicatedLinear(2 * h, h, tp, quant_format(cfg, "mtp", ["fc"]))
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, rotary, tp, f"mtp.layers.{i}", cfg.is_moe)
                                    for i in range(cfg.mtp_num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.tp = tp

    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # next_embeds: embed(x_{t+1}) [T, hidden]; hidden: h_t [T, hidden]; positions: t [T] -> g [T, hidden]
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], -1))
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return reduce_add_norm(self.tp, self.norm, x, residual)[0]


# Checkpoint name fragment -> (fused parameter fragment, shard id)
_FUSED = {
    ".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
}


class Qwen3ForCausalLM(nn.Module):
    FUSED = _FUSED              # checkpoint name fragment -> (fused parameter fragment, shard id)
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE_RANK, with_mtp: bool = True,
                 max_position: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, max_position or cfg.max_position_embeddings, cfg.rope_theta)
        self.model = Qwen3Model(cfg, self.rotary, tp)
        # vocabulary rows split over ranks: each rank reads 1/tp of the lm_head per step
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = MTPModule(cfg, self.rotary, tp) if with_mtp and cfg.mtp_num_hidden_layers > 0 else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, num_rows: int | None = None) -> torch.Tensor:
        # hidden: [N, hidden] -> logits [N, vocab] (or [N, num_rows] over the first ids)
        return self.lm_head(hidden, num_rows)

    def draft_hidden(self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # next_ids: x_{t+1} [T]; hidden: h_t [T, hidden]; positions: t [T] -> g_t [T, hidden]
        return self.mtp(self.model.embed_tokens(next_ids), hidden, positions)

    def attention_layers(self) -> list[PagedAttention]:
        """Main layers first, then MTP layers: the index is the KV pool's layer index."""
        layers = list(self.model.layers) + (list(self.mtp.layers) if self.mtp is not None else [])
        return [layer.self_attn.attn for layer in layers]

    # -- weights ---------------------------------------------------------------------------------

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must provide, by its Hugging Face name, unsharded."""
        cfg, h, d = self.cfg, self.cfg.hidden_size, self.cfg.head_dim
        q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d

        def layer(prefix: str, sparse: bool) -> dict[str, tuple[int, ...]]:
            return {
                f"{prefix}.input_layernorm.weight": (h,), f"{prefix}.post_attention_layernorm.weight": (h,),
                f"{prefix}.self_attn.q_proj.weight": (q, h), f"{prefix}.self_attn.k_proj.weight": (kv, h),
                f"{prefix}.self_attn.v_proj.weight": (kv, h), f"{prefix}.self_attn.o_proj.weight": (h, q),
                f"{prefix}.self_attn.q_norm.weight": (d,), f"{prefix}.self_attn.k_norm.weight": (d,),
                **mlp_checkpoint_shapes(cfg, f"{prefix}.mlp", sparse),
            }

        shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
        if not cfg.tie_word_embeddings:
            shapes["lm_head.weight"] = (cfg.vocab_size, h)
        for i in range(cfg.num_hidden_layers):
            shapes.update(layer(f"model.layers.{i}", cfg.layer_is_moe(i)))
        if self.mtp is not None:
            shapes.update({"mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,),
                           "mtp.fc.weight": (h, 2 * h), "mtp.norm.weight": (h,)})
            for i in range(cfg.mtp_num_hidden_layers):
                shapes.update(layer(f"mtp.layers.{i}", cfg.is_moe))
        if cfg.quant is not None:
            from engine.quant.scheme import quantized_shapes
            shapes = quantized_shapes(shapes, cfg.quant)
        return shapes

    def fused_name(self, name: str) -> tuple[str, object]:
        """The parameter a checkpoint tensor loads into, and its shard id in that fused layer (or None)."""
        for part, (fused, shard_id) in self.FUSED.items():
            if part in name:
                return name.replace(part, fused), shard_id
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (names already checked by the loader) into this rank's parameters."""
        from engine.quant.scheme import canonical_weights
        params = dict(self.named_parameters(remove_duplicate=False))
        # quantized modules' tensors as the layers hold them (engine.quant.layouts: repacked, transposed, ...)
        for name, tensor in canonical_weights(weights, self.cfg.quant):
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            checkpoint_name = name
            name, shard_id = self.fused_name(name)
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if getattr(param, "quantized", False) and tensor.dtype != param.dtype:
                raise ModelLoadError(f"{checkpoint_name}: dtype {tensor.dtype}, the quantized layout needs {param.dtype}")
            tensor = tensor.to(device=param.device, dtype=param.dtype)
            if loader is None:
                param.data.copy_(tensor)
                continue
            try:
                loader(param, tensor, shard_id)
            except ModelLoadError as e:
                raise ModelLoadError(f"{checkpoint_name}: {e}") from None
