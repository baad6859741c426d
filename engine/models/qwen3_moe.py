"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 (engine.models.qwen3) with the MLP of its sparse
layers a mixture of experts (engine.layers.moe: softmax top-k router, no shared expert). Which
layers are sparse is `ModelConfig.layer_is_moe` (decoder_sparse_step, mlp_only_layers); the MTP
layer, where a checkpoint has one, is sparse too.

The experts load from per-expert tensors or from fused `gate_up_proj` / `down_proj` stacks
(engine.layers.moe_experts); every other tensor is Qwen3's."""

from __future__ import annotations

from dataclasses import replace

from engine.config import ModelConfig
from engine.layers.moe_experts import dequantized_experts, expert_param_name
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.quant.dequantize_at_load import DequantizeAtLoad


class ExpertWeights:
    """Mixin of the MoE models: the experts' checkpoint tensors load into their stacked parameters, and
    checkpoint modules the layers hold unquantized (`dequantized_modules`) are dequantized while they load."""

    def __init__(self, cfg: ModelConfig, *args, **kwargs):
        at_load = DequantizeAtLoad(cfg.quant, self.dequantized_modules(cfg), self.DEQUANTIZED_WHY)
        layer_quant = self.layer_scheme(cfg.quant, at_load)
        super().__init__(replace(cfg, quant=layer_quant) if layer_quant is not cfg.quant else cfg, *args, **kwargs)
        self.checkpoint_quant, self.at_load = cfg.quant, at_load

    @classmethod
    def layer_scheme(cls, scheme, at_load: DequantizeAtLoad):
        """The scheme the layers are built with (the checkpoint's, less what loads dequantized)."""
        return at_load.layer_scheme()

    DEQUANTIZED_WHY = "experts quantized in a layout the expert kernels do not run (integer, FP8 per channel)"

    @classmethod
    def dequantized_modules(cls, cfg: ModelConfig) -> set[str]:
        return dequantized_experts(cfg.quant)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.at_load.disk_shapes(super().checkpoint_shapes(), lambda m: ".experts." in m)

    def load_weights(self, weights) -> None:
        if self.at_load.modules and not self.at_load.plain:
            self.checkpoint_shapes()                       # records the unquantized shape of each such module
        device = next(self.parameters()).device
        super().load_weights(self.renamed_weights(self.at_load(weights, device)))

    def renamed_weights(self, weights):
        """The checkpoint stream (modules dequantized already) as the layers name their tensors."""
        return weights

    def fused_name(self, name: str) -> tuple[str, object]:
        hit = expert_param_name(name)
        return hit if hit is not None else super().fused_name(name)


class Qwen3MoeForCausalLM(ExpertWeights, Qwen3ForCausalLM):
    """Qwen3ForCausalLM's interface; the sparse layers are chosen by the config (Qwen3DecoderLayer `sparse`)."""
