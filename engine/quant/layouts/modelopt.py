"""NVIDIA ModelOpt (`quant_method: modelopt`) and Qwen's FP8 blocks (`quant_method: fp8`).

ModelOpt NVFP4 (`quant_algo: NVFP4`, group_size 16), one linear layer:
    weight uint8 [out, in/2] (E2M1 pairs, even column in the low nibble), weight_scale float8_e4m3fn
    [out, in/16], weight_scale_2 float32 [] (a multiplier), input_scale float32 [] (W4A4; not used)
ModelOpt FP8 (`quant_algo: FP8`, the layout of NVIDIA's FP8 releases):
    weight float8_e4m3fn [out, in], weight_scale float32 [] (W = weight * weight_scale), input_scale
    float32 [] (a static activation scale; not used: the engine quantizes activations per token)
    Fused q/k/v and gate/up parts have different weight scales: each part keeps its own, loaded as 128x128
    block scales all equal to it (exact; no re-rounding to a common scale), so FP8 blocks' kernels run it.
Qwen FP8 (`quant_method: fp8`, `weight_block_size: [128, 128]`):
    weight float8_e4m3fn [out, in], weight_scale_inv float32 [ceil(out/128), ceil(in/128)]

ModelOpt writes its exclusions as hf_quant_config.json's `exclude_modules`, and (0.47) as config.json's
`ignore` beside `config_groups`; either is read. It drops `mtp.*` (transformers does not know them): an MTP
head can come from another directory (`--speculative-model`).
"""

from __future__ import annotations

from engine.errors import ModelLoadError
from engine.quant.layouts.base import FP8, NVFP4, Layout, LinearQuant, matches, per_rows


def _blocks(n: int, b: int = 128) -> int:
    return -(-n // b)


class _Excluding(Layout):
    def __init__(self, exclude: tuple[str, ...] = (), field: str = "exclude_modules"):
        self.exclude, self.field = tuple(exclude), field

    def excluded_by(self, module: str) -> str | None:
        return self.field if any(matches(module, p) for p in self.exclude) else None


class ModelOptNVFP4(_Excluding):
    name = "ModelOpt NVFP4"
    markers = ("weight_scale",)
    scalars = ("weight_scale_2", "input_scale")
    optional = ("input_scale",)

    def linear_quant(self, module: str) -> LinearQuant:
        return LinearQuant(NVFP4)

    def disk_shapes(self, module, spec, out, inp):
        if inp % 16:
            raise ModelLoadError(f"{module}.weight: in_features {inp} is not a multiple of group_size 16")
        return {f"{module}.weight": (out, inp // 2), f"{module}.weight_scale": (out, inp // 16),
                f"{module}.weight_scale_2": ()}

    def disk_dtypes(self, spec):
        return {"weight": ("U8",), "weight_scale": ("F8_E4M3",), "weight_scale_2": ("F32",), "input_scale": ("F32",)}

    def convert(self, module, suffix, tensor, spec):
        if suffix == "weight_scale_2":
            return [("weight_scale_2", per_rows(tensor))]
        return [] if suffix == "input_scale" else [(suffix, tensor)]


class ModelOptFP8(_Excluding):
    name = "ModelOpt FP8"
    markers = ("weight_scale",)
    scalars = ("weight_scale", "input_scale")
    optional = ("input_scale",)

    def linear_quant(self, module: str) -> LinearQuant:
        return LinearQuant(FP8)

    def disk_shapes(self, module, spec, out, inp):
        return {f"{module}.weight": (out, inp), f"{module}.weight_scale": ()}

    def disk_dtypes(self, spec):
        return {"weight": ("F8_E4M3",), "weight_scale": ("F32",), "input_scale": ("F32",)}

    def convert(self, module, suffix, tensor, spec):
        if suffix == "weight_scale":
            return [("weight_scale_inv", per_rows(tensor))]
        return [] if suffix == "input_scale" else [(suffix, tensor)]


class QwenFP8Blocks(_Excluding):
    name = "FP8 128x128 blocks"
    markers = ("weight_scale_inv",)

    def __init__(self, exclude: tuple[str, ...] = ()):
        super().__init__(exclude, "modules_to_not_convert")

    def linear_quant(self, module: str) -> LinearQuant:
        return LinearQuant(FP8)

    def disk_shapes(self, module, spec, out, inp):
        return {f"{module}.weight": (out, inp), f"{module}.weight_scale_inv": (_blocks(out), _blocks(inp))}

    def disk_dtypes(self, spec):
        return {"weight": ("F8_E4M3",), "weight_scale_inv": ("F32",)}

    def convert(self, module, suffix, tensor, spec):
        return [(suffix, tensor)]
