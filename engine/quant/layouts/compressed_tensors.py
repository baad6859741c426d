"""compressed-tensors (`quant_method: compressed-tensors`, what llmcompressor writes).

The config names groups of targets (`config_groups.G.targets`: a class name such as "Linear", a module
name, or `re:REGEX`) and one scheme per group; `ignore` lists modules kept unquantized (llmcompressor
expands its regexes into names). A module takes the scheme of the group whose targets match it. Three
formats are served, each per module (shapes for one linear [out, in]):

float-quantized (FP8_DYNAMIC, FP8, FP8_BLOCK): weight float8_e4m3fn [out, in], weight_scale in the model
    dtype: [out, 1] (strategy channel), [1] (tensor) or [ceil(out/128), ceil(in/128)] (block 128x128);
    input_scale [1] for static activations (read, not used: activations are quantized per token on the
    GPU's FP8 prefill and not at all on the CPU). Per-channel runs as the fp8_channel kind; per-tensor
    and blocks as FP8 blocks (a per-tensor scale fills every block of its part: exact).
pack-quantized (W4A16, W4A16_ASYM, W8A16, ...): weight_packed int32 [out, in*bits/32] packed along the
    input dim, each field q + 2^(bits-1) (signed q, unsigned offset, symmetric or not); weight_scale
    [out, in/group] ([out, 1] for strategy channel); weight_shape int [2]; asymmetric schemes add
    weight_zero_point int32 [ceil(out*bits/32), in/group] packed along the OUTPUT dim, with the same offset;
    actorder "group" adds weight_g_idx [in]. W = (field - zp_field) * scale (zp_field 2^(bits-1) when symmetric).
nvfp4-pack-quantized (NVFP4): weight_packed uint8 [out, in/2] (ModelOpt's nibble order), weight_scale
    float8_e4m3fn [out, in/16], weight_global_scale float32 [1], a DIVISOR (1 / ModelOpt's weight_scale_2);
    input_global_scale (W4A4 activations; not used).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ModelLoadError
from engine.quant.int_formats import pack_factor, unpack_int32
from engine.quant.layouts.base import FP8, FP8_CHANNEL, INT, NVFP4, Layout, LinearQuant, matches, per_rows

FORMATS = ("float-quantized", "pack-quantized", "nvfp4-pack-quantized")
FLOAT_SCALES = ("BF16", "F16", "F32")


@dataclass(frozen=True)
class _Group:
    name: str
    targets: tuple[str, ...]
    spec: LinearQuant
    strategy: str                  # the weights' strategy: tensor, channel, group, block, tensor_group
    symmetric: bool = True


class CompressedTensors(Layout):
    markers = ("weight_scale",)
    scalars = ("weight_scale", "input_scale", "weight_global_scale", "input_global_scale")
    optional = ("input_scale", "input_global_scale")

    def __init__(self, qc: dict):
        self.name = "compressed-tensors"
        for key, ok in (("quantization_status", ("compressed", None)), ("kv_cache_scheme", (None,))):
            if qc.get(key) not in ok:
                raise ModelLoadError(f"quantization_config.{key}={qc.get(key)!r} is not supported; supported: "
                                     + ", ".join(repr(v) for v in ok))
        for key in ("sparsity_config", "transform_config"):
            if qc.get(key):
                raise ModelLoadError(f"quantization_config.{key} is set ({', '.join(sorted(qc[key]))}); "
                                     "sparse and transformed (rotated) weights are not supported")
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            raise ModelLoadError("quantization_config.config_groups is missing or empty")
        self.ignore = tuple(qc.get("ignore") or ())
        self.groups = tuple(_parse_group(name, g, qc.get("format")) for name, g in groups.items())

    def _group(self, module: str) -> _Group | None:
        found = [g for g in self.groups if any(t == "Linear" or matches(module, t) for t in g.targets)]
        if len(found) > 1 and len({(g.spec, g.symmetric) for g in found}) > 1:
            raise ModelLoadError(f"{module}: targeted by quantization_config.config_groups "
                                 f"{', '.join(g.name for g in found)} with different schemes")
        return found[0] if found else None

    def excluded_by(self, module: str) -> str | None:
        if any(p == "Linear" or matches(module, p) for p in self.ignore):
            return "quantization_config.ignore"
        return None if self._group(module) else "quantization_config.config_groups (no targets match it)"

    def linear_quant(self, module: str) -> LinearQuant:
        return self._group(module).spec

    def disk_shapes(self, module, spec, out, inp):
        g, m = self._group(module), module
        if spec.kind == NVFP4:
            if inp % 16:
                raise ModelLoadError(f"{m}.weight_packed: in_features {inp} is not a multiple of group_size 16")
            return {f"{m}.weight_packed": (out, inp // 2), f"{m}.weight_scale": (out, inp // 16),
                    f"{m}.weight_global_scale": ()}
        if spec.kind in (FP8, FP8_CHANNEL):
            scale = {"tensor": (), "channel": (out, 1), "block": (-(-out // 128), -(-inp // 128))}[g.strategy]
            return {f"{m}.weight": (out, inp), f"{m}.weight_scale": scale}
        bits, gs = spec.bits, spec.group_size
        if inp % pack_factor(bits) or (gs and inp % gs):
            raise ModelLoadError(f"{m}.weight_packed: in_features {inp} is not a multiple of group_size {gs} "
                                 f"and of {pack_factor(bits)} ({bits}-bit fields in int32 words)")
        groups = inp // gs if gs else 1
        shapes = {f"{m}.weight_packed": (out, inp // pack_factor(bits)), f"{m}.weight_scale": (out, groups),
                  f"{m}.weight_shape": (2,)}
        if not g.symmetric:
            shapes[f"{m}.weight_zero_point"] = (-(-out // pack_factor(bits)), groups)
        if spec.act_order:
            shapes[f"{m}.weight_g_idx"] = (inp,)
        return shapes

    def disk_dtypes(self, spec):
        if spec.kind == NVFP4:
            return {"weight_packed": ("U8",), "weight_scale": ("F8_E4M3",), "weight_global_scale": ("F32",)}
        if spec.kind in (FP8, FP8_CHANNEL):
            return {"weight": ("F8_E4M3",), "weight_scale": FLOAT_SCALES, "input_scale": FLOAT_SCALES}
        return {"weight_packed": ("I32",), "weight_scale": FLOAT_SCALES, "weight_zero_point": ("I32",),
                "weight_shape": ("I64", "I32"), "weight_g_idx": ("I32", "I64")}

    def convert(self, module, suffix, tensor, spec):
        if suffix in self.optional or suffix == "weight_shape":
            return []
        if spec.kind == NVFP4:
            if suffix == "weight_global_scale":
                return [("weight_scale_2", per_rows(1.0 / tensor.float()))]
            return [({"weight_packed": "weight"}.get(suffix, suffix), tensor)]
        if spec.kind == FP8:
            if suffix == "weight_scale":
                block = self._group(module).strategy == "block"
                return [("weight_scale_inv", tensor.float() if block else per_rows(tensor))]
            return [(suffix, tensor)]
        if spec.kind == FP8_CHANNEL:
            return [("weight_scale", tensor.float().reshape(-1))] if suffix == "weight_scale" else [(suffix, tensor)]
        return {"weight_packed": lambda: [("qweight", tensor)],
                "weight_scale": lambda: [("scales", tensor.float())],
                # padded rows past `out` (the last word's unused fields) are never loaded
                "weight_zero_point": lambda: [("zeros", unpack_int32(tensor, spec.bits, 0).float())],
                "weight_g_idx": lambda: [("g_idx", tensor.int())]}[suffix]()


def _parse_group(name: str, g: dict, top_format) -> _Group:
    where = f"config_groups.{name}."
    fmt = g.get("format") or top_format
    if fmt not in FORMATS:
        raise ModelLoadError(f"quantization_config.{where}format={fmt!r} is not supported; supported: "
                             + ", ".join(FORMATS))
    w = g.get("weights") or {}
    if g.get("output_activations"):
        raise ModelLoadError(f"quantization_config.{where}output_activations is set; output quantization is not supported")
    act = g.get("input_activations")
    if act and act.get("type") != "float":
        raise ModelLoadError(f"quantization_config.{where}input_activations.type={act.get('type')!r} is not supported "
                             "(integer activations, W8A8-int); supported: float (FP8/NVFP4 activations) or none")
    if w.get("dynamic"):
        raise ModelLoadError(f"quantization_config.{where}weights.dynamic=true is not supported")
    kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    targets = tuple(g.get("targets") or ())
    if fmt == "float-quantized":
        if kind != "float" or bits != 8:
            raise ModelLoadError(f"quantization_config.{where}weights: float-quantized needs type float and num_bits 8, "
                                 f"got type={kind!r} num_bits={bits!r}")
        if strategy not in ("tensor", "channel", "block"):
            raise ModelLoadError(f"quantization_config.{where}weights.strategy={strategy!r} is not supported; "
                                 "supported: tensor, channel, block")
        if strategy == "block" and list(w.get("block_structure") or ()) != [128, 128]:
            raise ModelLoadError(f"quantization_config.{where}weights.block_structure={w.get('block_structure')!r} "
                                 "is not supported; FP8 blocks need [128, 128]")
        return _Group(name, targets, LinearQuant(FP8_CHANNEL if strategy == "channel" else FP8), strategy)
    if fmt == "nvfp4-pack-quantized":
        if kind != "float" or bits != 4 or w.get("group_size") != 16:
            raise ModelLoadError(f"quantization_config.{where}weights: nvfp4-pack-quantized needs type float, num_bits 4 "
                                 f"and group_size 16, got {kind!r}, {bits!r}, {w.get('group_size')!r}")
        return _Group(name, targets, LinearQuant(NVFP4), strategy)
    if kind != "int" or bits not in (4, 8):
        raise ModelLoadError(f"quantization_config.{where}weights: pack-quantized needs type int and num_bits 4 or 8, "
                             f"got type={kind!r} num_bits={bits!r}")
    if strategy not in ("group", "channel"):
        raise ModelLoadError(f"quantization_config.{where}weights.strategy={strategy!r} is not supported; "
                             "supported: group, channel")
    gs = int(w.get("group_size") or 0) if strategy == "group" else 0
    if strategy == "group" and gs <= 0:
        raise ModelLoadError(f"quantization_config.{where}weights.group_size={w.get('group_size')!r}: strategy group "
                             "needs a positive group_size")
    act_order = w.get("actorder") in ("group", "dynamic")
    return _Group(name, targets, LinearQuant(INT, bits, gs, act_order), strategy, bool(w.get("symmetric", True)))
