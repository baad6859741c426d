"""The routed experts of a sparse MoE block: every expert's projections stacked in one tensor per kind.

    w13  [E, 2 I_rank, H]   gate rows of this rank, then its up rows (transformers' `gate_up_proj`
                            order: concatenated, not interleaved)
    w2   [E, H, I_rank]     down projection, this rank's columns

Tensor parallelism splits every expert on its intermediate dimension (I_rank = I / tp): each rank
runs its slice of every chosen expert and the block's output is a partial sum, reduced once per
layer with the residual add and the next norm (engine.layers.reduce_add_norm). The router and the
experts' choice are replicated: every rank computes the same routing.

Checkpoint layouts, both loaded anywhere in a model (docs/moe.md):
- per expert: `X.experts.{e}.gate_proj.weight [I, H]`, `.up_proj.weight [I, H]`, `.down_proj.weight [H, I]`
  (Qwen3-MoE, Qwen3-Next, the MTP layer of Qwen3.5-MoE, transformers' `save_pretrained`), and the
  quantized forms of the same modules (FP8 `weight_scale_inv`, NVFP4 `weight_scale` / `weight_scale_2`, here;
  integer and FP8 per-channel experts arrive dequantized: `dequantized_experts`);
- fused: `X.experts.gate_up_proj [E, 2I, H]`, `X.experts.down_proj [E, H, I]` (Qwen3.5-MoE's main layers;
  unquantized only: `refuse_quantized_fused`).
The quantized parameters follow engine.quant.linear's layouts with an expert dimension in front: FP8
`w13_weight_scale_inv [E, 2 I_rank / br, ceil(H / 128)]` (br = gcd(128, I_rank): a rank's slice or the
up part never starts inside a scale block), NVFP4 packed codes, E4M3 group scales, and the per-tensor
scale kept per output row (`w13_weight_scale_2 [E, 2 I_rank]`, `w2_weight_scale_2 [E, H]`).
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from engine.distributed.tp_group import SINGLE_RANK, TPGroup
from engine.errors import ModelLoadError
from engine.quant import formats
from engine.quant.scheme import FP8, NVFP4

PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\."
                        r"(?P<field>weight|weight_scale_inv|weight_scale|weight_scale_2)$")
FUSED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<part>gate_up_proj|down_proj)$")
PARTS = ("gate_proj", "up_proj", "down_proj")


def expert_param_name(name: str) -> tuple[str, tuple[int | None, str]] | None:
    """The stacked parameter a checkpoint tensor of the experts loads into, and its shard id
    (expert or None for a fused tensor, part); None for any other tensor."""
    m = PER_EXPERT.match(name)
    if m is not None:
        proj = "w2" if m["part"] == "down_proj" else "w13"
        return f"{m['prefix']}.{proj}_{m['field']}", (int(m["expert"]), m["part"])
    m = FUSED.match(name)
    if m is not None:
        return f"{m['prefix']}.{'w13' if m['part'] == 'gate_up_proj' else 'w2'}_weight", (None, m["part"])
    return None


# a fused stack's companions (`experts.gate_up_proj_scale_inv`, `experts.down_proj.weight_scale`, ...)
FUSED_COMPANION = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<part>gate_up_proj|down_proj)[._].+$")
FLOAT_HEADER_DTYPES = ("F32", "BF16", "F16")


def refuse_quantized_fused(dtypes: dict[str, str]) -> None:
    """Quantized experts are read per expert only (the form ModelOpt, llmcompressor, gptqmodel and Qwen's FP8
    releases write): a fused stack (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj`) stored quantized, or
    carrying scales, is refused naming its tensors."""
    bad = sorted(f"{n} ({d})" for n, d in dtypes.items()
                 if (FUSED.match(n) and d not in FLOAT_HEADER_DTYPES) or FUSED_COMPANION.match(n))
    if bad:
        shown = ", ".join(bad[:6]) + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
        raise ModelLoadError(f"quantized fused expert stacks are not read: {shown}; quantized experts load per expert "
                             "(X.experts.{e}.gate_proj / up_proj / down_proj with their scales), fused stacks unquantized")


def per_expert_shapes(found: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Checkpoint shapes with every fused expert tensor stated as the per-expert tensors it holds, so that
    one expected layout checks both (a fused tensor whose shape cannot split stays, and is reported)."""
    out = {}
    for name, shape in found.items():
        m = FUSED.match(name)
        if m is None or len(shape) != 3 or (m["part"] == "gate_up_proj" and shape[1] % 2):
            out[name] = shape
            continue
        e, rows, cols = shape
        for i in range(e):
            if m["part"] == "gate_up_proj":
                out[f"{m['prefix']}.{i}.gate_proj.weight"] = (rows // 2, cols)
                out[f"{m['prefix']}.{i}.up_proj.weight"] = (rows // 2, cols)
            else:
                out[f"{m['prefix']}.{i}.down_proj.weight"] = (rows, cols)
    return out


def checkpoint_shapes(prefix: str, num_experts: int, hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    """The unquantized per-expert tensors of `prefix` (`...mlp.experts`)."""
    shapes = {}
    for e in range(num_experts):
        shapes[f"{prefix}.{e}.gate_proj.weight"] = (intermediate, hidden)
        shapes[f"{prefix}.{e}.up_proj.weight"] = (intermediate, hidden)
        shapes[f"{prefix}.{e}.down_proj.weight"] = (hidden, intermediate)
    return shapes


EXPERT_MODULE = re.compile(r"^.+\.experts\.\d+\.(gate_proj|up_proj|down_proj)$")


def dequantized_experts(quant) -> set[str]:
    """The per-expert checkpoint modules quantized in a kind the expert kernels do not run (integer -- GPTQ, AWQ,
    compressed-tensors pack-quantized -- and FP8 per channel): the layers hold them in the model dtype,
    dequantized at load (engine.quant.dequantize_at_load)."""
    if quant is None:
        return set()
    return {m for m in quant.modules or () if EXPERT_MODULE.match(m) and quant.spec(m).kind not in (FP8, NVFP4)}


def experts_format(quant, prefix: str, num_experts: int) -> str | None:
    """The one format of every expert under `prefix` (a checkpoint mixing formats across experts is refused)."""
    if quant is None:
        return None
    formats_seen = {quant.layer_format(f"{prefix}.{e}", list(PARTS)) for e in range(num_experts)}
    if len(formats_seen) > 1:
        raise ModelLoadError(f"{prefix}: some experts are quantized and some are not; all or none must be")
    spec = formats_seen.pop()                       # an engine.quant.layouts.LinearQuant, or None
    if spec is not None and spec.kind not in (FP8, NVFP4):
        raise ModelLoadError(f"{prefix}: experts quantized as {spec.kind} ({quant.format}) are not supported; "
                             "supported: FP8 128x128 blocks, NVFP4")
    return None if spec is None else spec.kind


def _param(shape, dtype, row_div: int = 1, col_div: int = 1, expand=None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype) if dtype is not None else torch.empty(shape), requires_grad=False)
    p.row_div, p.col_div, p.expand_loaded = row_div, col_div, expand
    p.quantized = dtype is not None              # stored as is: no cast to the model dtype
    return p


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup = SINGLE_RANK,
                 quant: str | None = None):
        super().__init__()
        self.tp, self.quant = tp, quant
        self.num_experts, self.hidden = num_experts, hidden
        self.intermediate = tp.shard(intermediate, "moe_intermediate_size")       # I_rank
        E, H, I = num_experts, hidden, self.intermediate
        if quant is None:
            self.w13_weight = _param((E, 2 * I, H), None)
            self.w2_weight = _param((E, H, I), None)
        elif quant == FP8:
            bR, bC = formats.FP8_BLOCK
            br13, bc2 = math.gcd(bR, I), math.gcd(bC, I)
            self.scale_block13, self.scale_block2 = (br13, bC), (bR, bc2)
            self.w13_weight = _param((E, 2 * I, H), formats.FP8)
            self.w13_weight_scale_inv = _param((E, 2 * I // br13, -(-H // bC)), torch.float32, br13, bC,
                                               lambda s: s.repeat_interleave(bR // br13, 0))
            self.w2_weight = _param((E, H, I), formats.FP8)
            self.w2_weight_scale_inv = _param((E, -(-H // bR), I // bc2), torch.float32, bR, bc2,
                                              lambda s: s.repeat_interleave(bC // bc2, 1))
        elif quant == NVFP4:
            g = formats.NVFP4_GROUP
            if H % g or I % g:
                raise ModelLoadError(f"NVFP4 experts: hidden {H} and moe_intermediate_size per rank {I} must be "
                                     f"multiples of the group size {g}")
            self.w13_weight = _param((E, 2 * I, H // 2), torch.uint8, col_div=2)
            self.w13_weight_scale = _param((E, 2 * I, H // g), formats.FP8, col_div=g)
            self.w13_weight_scale_2 = _param((E, 2 * I), torch.float32)
            self.w2_weight = _param((E, H, I // 2), torch.uint8, col_div=2)
            self.w2_weight_scale = _param((E, H, I // g), formats.FP8, col_div=g)
            self.w2_weight_scale_2 = _param((E, H), torch.float32)
        else:
            raise ModelLoadError(f"unknown quantized format {quant!r} for experts")
        for p in self.parameters(recurse=False):
            p.weight_loader = self.weight_loader

    # -- loading ---------------------------------------------------------------------------------

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int | None, str]) -> None:
        expert, part = shard_id
        if expert is not None:
            return self._load_part(param, param.data[expert], loaded, part)
        if loaded.shape[0] != self.num_experts:
            raise ModelLoadError(f"fused experts tensor of {loaded.shape[0]} experts for a layer of {self.num_experts}")
        for e in range(self.num_experts):
            if part == "gate_up_proj":
                gate, up = loaded[e].chunk(2, dim=0)
                self._load_part(param, param.data[e], gate, "gate_proj")
                self._load_part(param, param.data[e], up, "up_proj")
            else:
                self._load_part(param, param.data[e], loaded[e], "down_proj")

    def _load_part(self, param: nn.Parameter, dst: torch.Tensor, loaded: torch.Tensor, part: str) -> None:
        # dst: one expert's slice of `param`; loaded: the checkpoint tensor of that expert's `part`
        I, rank = self.intermediate, self.tp.rank
        if dst.dim() == 1:                                   # NVFP4 per-tensor scale, kept per output row
            rows = dst if part == "down_proj" else dst.narrow(0, 0 if part == "gate_proj" else I, I)
            rows.fill_(loaded.reshape(()))
            return
        if param.expand_loaded is not None:
            loaded = param.expand_loaded(loaded)
        rdiv, cdiv = param.row_div, param.col_div
        if part == "down_proj":                              # columns of this rank
            dst.copy_(loaded.narrow(1, rank * I // cdiv, I // cdiv))
        else:                                                # rows of this rank, gate then up
            first = 0 if part == "gate_proj" else I
            dst.narrow(0, first // rdiv, I // rdiv).copy_(loaded.narrow(0, rank * I // rdiv, I // rdiv))

    # -- the CPU path ----------------------------------------------------------------------------

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (w13 [2 I_rank, H], w2 [H, I_rank]), dequantized to float32 by the reference where quantized."""
        if self.quant is None:
            return self.w13_weight[e], self.w2_weight[e]
        if self.quant == FP8:
            return (formats.dequantize_fp8_block(self.w13_weight[e], self.w13_weight_scale_inv[e], self.scale_block13),
                    formats.dequantize_fp8_block(self.w2_weight[e], self.w2_weight_scale_inv[e], self.scale_block2))
        return (formats.dequantize_nvfp4(self.w13_weight[e], self.w13_weight_scale[e], 1.0)
                * self.w13_weight_scale_2[e][:, None],
                formats.dequantize_nvfp4(self.w2_weight[e], self.w2_weight_scale[e], 1.0) * self.w2_weight_scale_2[e][:, None])

    def bytes_per_expert(self) -> int:
        """Bytes of one expert's weights on this rank (scales included): what a decode step reads per chosen expert."""
        return sum(p[0].numel() * p.element_size() for p in self.parameters(recurse=False))
