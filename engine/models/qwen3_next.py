"""Qwen3-Next (Qwen3-Next-80B-A3B): the Qwen3.5-MoE model (engine.models.qwen3_5_moe) in another checkpoint layout.

The token mixers, norms, MoE blocks (with the gated shared expert) and the MTP layer compute exactly what
Qwen3.5-MoE's do; the one structural difference is how the Gated DeltaNet's input projections are stored.
Qwen3-Next fuses them per key-head group g (r = value heads per key head):

    in_proj_qkvz [Hk (2 dk + 2 r dv), H]    rows of group g: q_g (dk) | k_g (dk) | v_g (r dv) | z_g (r dv)
    in_proj_ba   [Hk 2 r, H]                rows of group g: b_g (r) | a_g (r)

Qwen3.5 keeps them flat: in_proj_qkv = [all q | all k | all v] (the conv's channel order), in_proj_z,
in_proj_b, in_proj_a. The loader permutes the rows at load (`split_projections`) and the layer is
Qwen3.5's GatedDeltaNet, so both architectures run one code path. Where a producer quantized the grouped
projections, row-wise layouts (NVFP4, FP8 per channel, integer) are converted to the layer's tensors and their
rows permuted alike (they stay quantized); FP8 128x128 blocks, which the permutation would cut, are dequantized
at load (engine.quant.dequantize_at_load). Qwen3-Next also honours
decoder_sparse_step / mlp_only_layers (dense layers where they say; none in published checkpoints)
and renormalises its top k only when norm_topk_prob.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
from engine.quant.dequantize_at_load import ModuleTensors
from engine.quant.layouts.base import FP8_CHANNEL, INT, NVFP4, Renamed

FLAT = (".in_proj_qkv.weight", ".in_proj_z.weight", ".in_proj_b.weight", ".in_proj_a.weight")
GROUPED = (".in_proj_qkvz", ".in_proj_ba")
PARTS = {".in_proj_qkvz": ("qkv", "z"), ".in_proj_ba": ("b", "a")}
# quantized kinds whose layer tensors hold one row per output row (or one value): their rows permute exactly
ROW_KINDS = (NVFP4, FP8_CHANNEL, INT)


def grouped_modules(scheme) -> set[str]:
    return {m for m in (scheme.modules or ()) if m.endswith(GROUPED)} if scheme is not None else set()


def kept_grouped(scheme) -> set[str]:
    """Quantized grouped projections that stay quantized: their converted rows are permuted as the weights'."""
    return {m for m in grouped_modules(scheme) if scheme.spec(m).kind in ROW_KINDS}


def flat_aliases(modules: Iterable[str]) -> dict[str, str]:
    """Qwen3.5's flat module name -> the grouped checkpoint module it comes from."""
    out = {}
    for m in modules:
        key = next(k for k in GROUPED if m.endswith(k))
        out.update({f"{m[:-len(key)]}.in_proj_{part}": m for part in PARTS[key]})
    return out



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
    DEQUANTIZED_WHY = ("experts in a layout the expert kernels do not run; grouped DeltaNet input projections in FP8 "
                       "blocks, which their rows' permutation into Qwen3.5's order would cut")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kept = kept_grouped(self.checkpoint_quant)
        self.kept_plain: dict[str, tuple[int, int]] = {}        # module -> its unquantized [out, in]

    @classmethod
    def dequantized_modules(cls, cfg: ModelConfig) -> set[str]:
        return super().dequantized_modules(cfg) | (grouped_modules(cfg.quant) - kept_grouped(cfg.quant))

    @classmethod
    def layer_scheme(cls, scheme, at_load):
        """Quantized grouped projections kept quantized appear to the layers as Qwen3.5's flat modules."""
        base, kept = at_load.layer_scheme(), kept_grouped(scheme)
        if not kept:
            return base
        aliases = flat_aliases(kept)
        return replace(base, modules=(frozenset(base.modules or ()) - kept) | frozenset(aliases),
                       layout=Renamed(base.layout, aliases))

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
        shapes = self.at_load.disk_shapes(shapes, lambda m: m.endswith(GROUPED))
        if self.kept:
            from engine.quant.scheme import quantized_shapes
            self.kept_plain.update({m: shapes[f"{m}.weight"] for m in self.kept if f"{m}.weight" in shapes})
            shapes = quantized_shapes(shapes, replace(self.checkpoint_quant, modules=frozenset(self.kept)))
        return shapes

    def renamed_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Grouped in_proj_qkvz / in_proj_ba as the flat projections: unquantized (or dequantized already) weights
        split by rows; quantized ones converted to the layer's tensors first, whose rows are then split alike."""
        if self.kept and not self.kept_plain:
            self.checkpoint_shapes()                           # records the unquantized shape of each kept module
        gather = ModuleTensors(self.checkpoint_quant, self.kept_plain, "a grouped projection kept quantized")
        for name, tensor in weights:
            if name.rpartition(".")[0] in self.kept:
                complete = gather.add(name, tensor)
                if complete is not None:
                    yield from self._split_rows(*complete)
                continue
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
        gather.check_complete()

    def _split_rows(self, module: str, tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """A quantized grouped module's layer tensors as its flat parts': row-wise tensors take each part's rows,
        one-value scales and the act-order g_idx (over the input columns) go to every part."""
        key = next(k for k in GROUPED if module.endswith(k))
        base, out = module[:-len(key)], self.kept_plain[module][0]
        rows = torch.arange(out).unsqueeze(1)                                     # [out, 1]
        split = split_projections(self.cfg, rows if key == ".in_proj_qkvz" else None, rows if key == ".in_proj_ba" else None)
        for suffix, t in tensors.items():
            whole = t.numel() == 1 or suffix == "g_idx"
            if not whole and t.shape[0] != out:
                raise ModelLoadError(f"{module}.{suffix}: {list(t.shape)} has no row per output row ({out}); "
                                     "its rows cannot be split into Qwen3.5's projections")
            for part in PARTS[key]:
                piece = t if whole else t.index_select(0, split[part][:, 0].to(t.device))
                yield f"{base}.in_proj_{part}.{suffix}", piece
