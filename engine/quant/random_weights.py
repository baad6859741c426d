"""Random quantized weights made on the target device (benchmarks of large shapes).

Each linear layer's bf16 matrix is drawn like `engine.loading.checkpoint.RandomWeights` does (std 1/sqrt(fan_in))
and quantized on the device by the same reference quantizer the quantize tool uses, so the engine
loads exactly the tensors, dtypes and scale magnitudes a real checkpoint of that format holds,
through the loader path users run."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch

from engine.loading.checkpoint import RandomWeights
from engine.quant import formats, int_formats
from engine.quant.scheme import NVFP4, QuantScheme


def quantize_tensor(name: str, w: torch.Tensor, scheme: QuantScheme,
                    search: tuple[float, ...] = ()) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of module `name[:-7]` (`X.weight` [out, in]) in `scheme`'s format
    (`search`: NVFP4 group-scale fractions to try, see `formats.quantize_nvfp4`)."""
    module = name[:-len(".weight")]
    if scheme.format == "compressed-tensors":         # pack-quantized INT, symmetric (the "-w4a16" presets)
        spec = scheme.spec(module)
        q = int_formats.quantize_int(w, spec.bits, spec.group_size, symmetric=True)
        # codes u = q + 2^(bits-1) packed along the input: compressed-tensors' weight_packed as it is
        return {f"{module}.weight_packed": q["qweight"], f"{module}.weight_scale": q["scales"].to(torch.bfloat16),
                f"{module}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int64, device=w.device)}
    if scheme.format == NVFP4:
        packed, scale, scale_2 = formats.quantize_nvfp4(w, search=search)
        return {name: packed, f"{module}.weight_scale": scale, f"{module}.weight_scale_2": scale_2}
    q, scale_inv = formats.quantize_fp8_block(w, scheme.block)
    return {name: q, f"{module}.weight_scale_inv": scale_inv}


class RandomQuantWeights(RandomWeights):
    def __init__(self, shapes: dict[str, tuple[int, ...]], scheme: QuantScheme, device: str = "cpu", seed: int = 0):
        super().__init__(shapes, device, seed)        # bf16 shapes
        self.scheme = scheme

    @classmethod
    def for_model(cls, model_config, device: str, seed: int = 0) -> "RandomQuantWeights":
        from engine.models.registry import model_class
        with torch.device("meta"):
            bf16 = replace(model_config, quant=None)
            shapes = model_class(bf16)(bf16, with_mtp=True).checkpoint_shapes()
        return cls(shapes, model_config.quant, device, seed)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        from engine.quant.scheme import quantized_shapes
        return quantized_shapes(self._shapes, self.scheme)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        modules = self.scheme.modules or frozenset()
        for name, tensor in super().__iter__():
            if name.endswith(".weight") and name[:-len(".weight")] in modules:
                yield from quantize_tensor(name, tensor, self.scheme).items()
            else:
                yield name, tensor

    def on(self, device) -> "RandomQuantWeights":
        return RandomQuantWeights(self._shapes, self.scheme, str(device), self.seed)

    def without(self, prefix: str) -> "RandomQuantWeights":
        return RandomQuantWeights({n: s for n, s in self._shapes.items() if not n.startswith(prefix)},
                                  self.scheme, self.device, self.seed)
