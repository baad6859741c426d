"""Qwen3-Next (Qwen3-Next-80B-A3B): the Qwen3.5-MoE model (engine.models.qwen3_5_moe) in another checkpoint layout.

The token mixers, norms, MoE blocks (with the gated shared expert) and the MTP layer compute exactly what
Qwen3.5-MoE's do; the one structural difference is how the Gated DeltaNet's input projections are stored.
Qwen3-Next fuses them per key-head group g (r = value heads per key head):

    in_proj_qkvz [Hk (2 dk + 2 r dv), H]    rows of group g: q_g (dk) | k_g (dk) | v_g (r dv) | z_g (r dv)
    in_proj_ba   [Hk 2 r, H]                rows of group g: b_g (r) | a_g (r)

Qwen3.5 keeps them flat: in_proj_qkv = [all q | all k | all v] (the conv's channel order), in_proj_z,
in_proj_b, in_proj_a. The loader permutes the rows at load (`split_projections`) and the layer is
Qwen3.5's GatedDeltaNet, so both architectures run one code path. Where a producer quantized the grouped
projections (ModelOpt, llmcompressor, FP8 blocks) they are dequantized before the permutation
(engine.quant.dequantize_at_load: the rows of a quantized layout's scale blocks do not survive it in general). Qwen3-Next also honours
decoder_sparse_step / mlp_only_layers (dense layers where they say; none in published checkpoints)
and renormalises its top k only when norm_topk_prob.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from engine.config import ModelConfig
from engine.models.qwen3_5_moe import Qwen3_5MoeForCausalLM

FLAT = (".in_proj_qkv.weight", ".in_proj_z.weight", ".in_proj_b.weight", ".in_proj_a.weight")
GROUPED = (".in_proj_qkvz", ".in_proj_ba")


def split_projections(cfg: ModelConfig, qkvz: torch.Tensor | None, ba: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Qwen3-Next's grouped in_proj_qkvz / in_proj_ba rows as Qwen3.5's in_proj_qkv, _z, _b, _a (either may be None)."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, hv // hk
    out = {}
    if qkvz is not None:
        q, k, v, z = qkvz.reshape(hk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
        h = qkvz.shape[-1]
        out["qkv"] = torch.cat([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)])
        out["z"] = z.reshape(-1, h)
    if ba is not None:
        b, a = ba.reshape(hk, 2 * r, -1).split([r, r], dim=1)
        out["b"], out["a"] = b.reshape(-1, ba.shape[-1]), a.reshape(-1, ba.shape[-1])
    return out


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    DEQUANTIZED_WHY = ("experts in a layout the expert kernels do not run; grouped DeltaNet input projections, whose "
                       "rows are permuted into Qwen3.5's order at load")

    @classmethod
    def dequantized_modules(cls, cfg: ModelConfig) -> set[str]:
        grouped = {m for m in (cfg.quant.modules or ()) if m.endswith(GROUPED)} if cfg.quant is not None else set()
        return super().dequantized_modules(cfg) | grouped

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        cfg, h = self.cfg, self.cfg.hidden_size
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        shapes = {}
        for name, shape in super().checkpoint_shapes().items():
            if name.endswith(FLAT):
                base = name.rsplit(".in_proj_", 1)[0]
                shapes[f"{base}.in_proj_qkvz.weight"] = (hk * (2 * dk) + hv * 2 * dv, h)
                shapes[f"{base}.in_proj_ba.weight"] = (2 * hv, h)
            else:
                shapes[name] = shape
        return self.at_load.disk_shapes(shapes, lambda m: m.endswith(GROUPED))

    def renamed_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Grouped in_proj_qkvz / in_proj_ba (dequantized already where quantized) as the flat projections."""
        for name, tensor in weights:
            for packed, parts in ((".in_proj_qkvz.weight", ("qkv", "z")), (".in_proj_ba.weight", ("b", "a"))):
                if name.endswith(packed):
                    base = name[:-len(packed)]
                    split = split_projections(self.cfg, tensor if parts[0] == "qkv" else None,
                                              tensor if parts[0] == "b" else None)
                    for part in parts:
                        yield f"{base}.in_proj_{part}.weight", split[part]
                    break
            else:
                yield name, tensor
