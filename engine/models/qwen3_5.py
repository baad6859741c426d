"""Qwen3.5-class hybrids (Qwen3_5ForCausalLM) and their MTP module, as plain modules.

Layers follow `config.layer_types`: Gated DeltaNet linear attention (engine.layers.gated_delta, a
state slot per request) or gated full attention (engine.layers.gated_attention, paged KV). Every
RMSNorm is zero-centred except the DeltaNet's gated output norm. The MTP module has the contract
of Qwen3's (engine.models.qwen3.MTPModule: embedding first, h_t the final-normed hidden state)
with a gated full-attention layer of this architecture.

KV layer indices count the full-attention layers only (main, then MTP); linear layers are
indexed in their own list (`linear_layers()`), the state cache's order.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.gated_attention import GatedAttention
from engine.layers.gated_delta import GatedDeltaNet
from engine.layers.hybrid_norm import ZeroCentredRMSNorm
from engine.layers.norm import start_residual
from engine.layers.linear import ReplicatedLinear
from engine.layers.rotary import RotaryEmbedding
from engine.layers.reduce_add_norm import defer_reduce, reduce_add_norm
from engine.layers.moe import mlp_checkpoint_shapes
from engine.models.qwen3 import MTPModule, Qwen3ForCausalLM, Qwen3Model, make_mlp, mlp_output, quant_format
from engine.distributed.tp_group import SINGLE_RANK, TPGroup

LINEAR = "linear_attention"


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, rotary: RotaryEmbedding, tp: TPGroup, prefix: str,
                 sparse: bool = False):
        super().__init__()
        self.is_linear = layer_type == LINEAR
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, tp, lambda parts: quant_format(cfg, f"{prefix}.linear_attn", parts))
        else:
            self.self_attn = GatedAttention(cfg, rotary, tp, lambda parts: quant_format(cfg, f"{prefix}.self_attn", parts))
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = make_mlp(cfg, tp, f"{prefix}.mlp", sparse)
        self.tp = tp
        mixer = self.linear_attn.out_proj if self.is_linear else self.self_attn.o_proj
        defer_reduce(tp, mixer, mlp_output(self.mlp))

    def forward(self, positions, x, residual):
        # x, residual: [T, hidden]; residual None on the first layer. Returns the next (x, residual).
        # With TP > 1, x is this rank's partial sum whenever residual is given (engine.layers.reduce_add_norm).
        if residual is None:
            x, residual = self.input_layernorm(x), start_residual(x)
        else:
            x, residual = reduce_add_norm(self.tp, self.input_layernorm, x, residual)
        x = self.linear_attn(x) if self.is_linear else self.self_attn(positions, x)
        x, residual = reduce_add_norm(self.tp, self.post_attention_layernorm, x, residual)
        return self.mlp(x), residual


class HybridModel(Qwen3Model):
    """Qwen3's model (its forward) over the hybrid's layer pattern, with a zero-centred final norm."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TPGroup):
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, t, rotary, tp, f"model.layers.{i}", cfg.layer_is_moe(i))
                                    for i, t in enumerate(cfg.layer_types))
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tp = tp


class HybridMTPModule(MTPModule):
    """Qwen3's MTP module (its forward) with zero-centred norms and a gated full-attention layer:
    g_t = norm(layers(fc(concat(pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)))))."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TPGroup):
        nn.Module.__init__(self)
        h = cfg.hidden_size
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(h, cfg.rms_norm_eps)
        self.fc = ReplicatedLinear(2 * h, h, tp, quant_format(cfg, "mtp", ["fc"]))
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, "full_attention", rotary, tp, f"mtp.layers.{i}", cfg.is_moe)
                                    for i in range(cfg.mtp_num_hidden_layers))
        self.norm = ZeroCentredRMSNorm(h, cfg.rms_norm_eps)
        self.tp = tp


class Qwen3_5ForCausalLM(Qwen3ForCausalLM):
    """Same interface as Qwen3ForCausalLM (forward, compute_logits, draft_hidden, attention_layers,
    checkpoint_shapes, load_weights), plus `linear_layers()` and `commit_linear_states`."""

    # in_proj_b/a load into `in_proj` too, unless the layer keeps them apart (engine.layers.gated_delta)
    FUSED = {**Qwen3ForCausalLM.FUSED,
             **{f".linear_attn.in_proj_{p}.": (".linear_attn.in_proj.", p) for p in ("qkv", "z", "b", "a")}}

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE_RANK, with_mtp: bool = True,
                 max_position: int | None = None):
        nn.Module.__init__(self)
        self.cfg = cfg
        rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.rotary = RotaryEmbedding(rotary_dim, max_position or cfg.max_position_embeddings, cfg.rope_theta)
        self.model = HybridModel(cfg, self.rotary, tp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = HybridMTPModule(cfg, self.rotary, tp) if with_mtp and cfg.mtp_num_hidden_layers > 0 else None

    def fused_name(self, name: str) -> tuple[str, object]:
        fused, shard_id = super().fused_name(name)
        if shard_id in ("b", "a"):
            layer = self.get_submodule(name.split(".in_proj_")[0])
            if layer.in_proj_ba is not None:
                fused = fused.replace(".in_proj.", ".in_proj_ba.")
        return fused, shard_id

    def attention_layers(self):
        """Full-attention layers, main then MTP: the index is the KV pool's layer index."""
        layers = [l for l in self.model.layers if not l.is_linear]  # noqa: E741
        layers += list(self.mtp.layers) if self.mtp is not None else []
        return [layer.self_attn.attn for layer in layers]

    def linear_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if layer.is_linear]

    def commit_linear_states(self, num_kept: torch.Tensor) -> None:
        """After a verify forward: keep each row's state after its first num_kept [B] tokens."""
        for layer in self.linear_layers():
            layer.commit(num_kept)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        cfg, h, d = self.cfg, self.cfg.hidden_size, self.cfg.head_dim
        q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        hv, conv = cfg.linear_num_value_heads, 2 * key + value

        def layer(prefix: str, layer_type: str, sparse: bool) -> dict[str, tuple[int, ...]]:
            shapes = {f"{prefix}.input_layernorm.weight": (h,), f"{prefix}.post_attention_layernorm.weight": (h,),
                      **mlp_checkpoint_shapes(cfg, f"{prefix}.mlp", sparse)}
            a = f"{prefix}.linear_attn"
            if layer_type == LINEAR:
                shapes.update({
                    f"{a}.in_proj_qkv.weight": (conv, h), f"{a}.in_proj_z.weight": (value, h),
                    f"{a}.in_proj_b.weight": (hv, h), f"{a}.in_proj_a.weight": (hv, h),
                    f"{a}.conv1d.weight": (conv, 1, cfg.linear_conv_kernel_dim), f"{a}.A_log": (hv,),
                    f"{a}.dt_bias": (hv,), f"{a}.norm.weight": (cfg.linear_value_head_dim,),
                    f"{a}.out_proj.weight": (h, value)})
            else:
                s = f"{prefix}.self_attn"
                shapes.update({
                    f"{s}.q_proj.weight": (2 * q, h), f"{s}.k_proj.weight": (kv, h), f"{s}.v_proj.weight": (kv, h),
                    f"{s}.o_proj.weight": (h, q), f"{s}.q_norm.weight": (d,), f"{s}.k_norm.weight": (d,)})
            return shapes

        shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
        if not cfg.tie_word_embeddings:
            shapes["lm_head.weight"] = (cfg.vocab_size, h)
        for i, t in enumerate(cfg.layer_types):
            shapes.update(layer(f"model.layers.{i}", t, cfg.layer_is_moe(i)))
        if self.mtp is not None:
            shapes.update({"mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,),
                           "mtp.fc.weight": (h, 2 * h), "mtp.norm.weight": (h,)})
            for i in range(cfg.mtp_num_hidden_layers):
                shapes.update(layer(f"mtp.layers.{i}", "full_attention", cfg.is_moe))
        if cfg.quant is not None:
            from engine.quant.scheme import quantized_shapes
            shapes = quantized_shapes(shapes, cfg.quant)
        return shapes

    def load_weights(self, weights) -> None:
        # the checkpoint's conv1d weight [C, 1, kernel] fills the layer's [C_rank, kernel] parameter
        super().load_weights((name.replace(".conv1d.weight", ".conv_weight"), t) for name, t in weights)
