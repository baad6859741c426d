"""Quantized checkpoint modules that the engine holds in the model dtype: dequantized while they load.

Two cases (docs/moe.md, docs/quantization.md):
- routed experts quantized in a layout the expert kernels do not run (integer GPTQ / AWQ / compressed-tensors
  pack-quantized, FP8 per channel): the stacked experts are built unquantized and each expert's projection is
  dequantized by the reference as it arrives;
- Qwen3-Next's grouped DeltaNet input projections (`in_proj_qkvz`, `in_proj_ba`) in FP8 128x128 blocks: their
  rows are interleaved per key head and permuted at load into Qwen3.5's flat projections, which the 128-row
  scale blocks do not survive in general, so they are dequantized first (row-wise layouts are permuted
  quantized: engine.models.qwen3_next).

The checkpoint keeps its quantized tensors (their names, shapes and dtypes are checked as for any quantized
module); the layers see one float32 `X.weight` per module, cast to the model dtype by the loader. Dequantization
uses each layout's own conversion (`Layout.convert`) and the reference dequantizer of the quantized linear
layer (`engine.quant.linear.dequantized_weight`), so it is exactly what the CPU path of a quantized layer computes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

import structlog
import torch

from engine.errors import ModelLoadError
from engine.quant.scheme import QuantScheme

log = structlog.get_logger(__name__)


class ModuleTensors:
    """Gathers the checkpoint tensors of quantized modules out of a weight stream, each converted to its layer's
    tensors (`Layout.convert`), and hands a module over once the last tensor its layout names has come."""

    def __init__(self, scheme: QuantScheme, plain: dict[str, tuple[int, int]], why: str):
        self.scheme = scheme
        self.plain = plain                                      # module -> its unquantized [out, in]
        self.why = why
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # module -> layer tensors so far
        self.needed: dict[str, set[str]] = {}                   # module -> checkpoint suffixes still to come
        self.done: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> tuple[str, dict[str, torch.Tensor]] | None:
        """Take checkpoint tensor `name` of a module; (module, its layer tensors) when that was its last one."""
        module, _, suffix = name.rpartition(".")
        if module in self.done:                                 # an optional tensor after the module's last one
            return None
        if module not in self.plain:
            raise ModelLoadError(f"{name}: no unquantized shape known for {module} ({self.why})")
        spec = self.scheme.spec(module)
        need = self.needed.setdefault(module, {n.rpartition(".")[2] for n in self.scheme.layout.disk_shapes(
            module, spec, *self.plain[module])})
        for layer_suffix, converted in self.scheme.layout.convert(module, suffix, tensor, spec):
            self.pending.setdefault(module, {})[layer_suffix] = converted
        need.discard(suffix)
        if need:
            return None
        self.done.add(module)
        return module, self.pending.pop(module, {})

    def check_complete(self) -> None:
        """Refuse a stream that ended before some module's tensors all came, naming the missing ones."""
        incomplete = sorted(f"{m} (missing {', '.join(sorted(self.needed[m]))})" for m in self.needed
                            if m not in self.done)
        if incomplete:
            raise ModelLoadError(f"quantized modules with tensors missing: {'; '.join(incomplete[:4])}")


class DequantizeAtLoad:
    """The modules of `scheme` (a resolved checkpoint scheme) that load dequantized, and the stream that does it."""

    def __init__(self, scheme: QuantScheme | None, modules: Iterable[str], why: str = ""):
        self.scheme = scheme
        self.modules = frozenset(modules) if scheme is not None else frozenset()
        self.why = why
        self.plain: dict[str, tuple[int, int]] = {}        # module -> its unquantized [out, in]

    def layer_scheme(self) -> QuantScheme | None:
        """The scheme the layers are built with: these modules unquantized."""
        if not self.modules:
            return self.scheme
        return replace(self.scheme, modules=frozenset(self.scheme.modules or ()) - self.modules)

    def disk_shapes(self, shapes: dict[str, tuple[int, ...]], which: Callable[[str], bool]) -> dict[str, tuple[int, ...]]:
        """`shapes` (unquantized names and shapes) with each module of ours that `which` accepts stated as the
        quantized tensors its checkpoint holds."""
        out: dict[str, tuple[int, ...]] = {}
        for name, shape in shapes.items():
            module = name[:-len(".weight")] if name.endswith(".weight") else None
            if module is None or module not in self.modules or not which(module) or len(shape) != 2:
                out[name] = shape
                continue
            self.plain[module] = (shape[0], shape[1])
            out.update(self.scheme.layout.disk_shapes(module, self.scheme.spec(module), shape[0], shape[1]))
        return out

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]],
                 device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint stream with each of our modules' tensors replaced by its dequantized `X.weight`
        (float32 [out, in], computed on `device`: the model's, so a GPU does the arithmetic), yielded as soon as
        the module's last tensor has come."""
        if not self.modules:
            yield from weights
            return
        log.info("dequantize_at_load", modules=len(self.modules), example=min(self.modules),
                 kinds=sorted({self.scheme.spec(m).kind for m in self.modules}), why=self.why)
        gather = ModuleTensors(self.scheme, self.plain, "dequantized at load")
        for name, tensor in weights:
            if name.rpartition(".")[0] not in self.modules:
                yield name, tensor
                continue
            complete = gather.add(name, tensor)
            if complete is not None:
                module, tensors = complete
                yield f"{module}.weight", self._dequantized(module, self.scheme.spec(module), tensors, device)
        gather.check_complete()

    def _dequantized(self, module: str, spec, tensors: dict[str, torch.Tensor], device) -> torch.Tensor:
        from engine.layers.linear import ReplicatedLinear
        from engine.quant.linear import dequantized_weight
        out, inp = self.plain[module]
        with torch.device(device):
            layer = ReplicatedLinear(inp, out, quant=spec.at(module))
        params = dict(layer.named_parameters())
        for suffix, tensor in tensors.items():
            param = params.get(suffix)
            if param is None:
                raise ModelLoadError(f"{module}.{suffix}: not a tensor of its {spec.kind} layout")
            if tensor.dtype != param.dtype:
                raise ModelLoadError(f"{module}.{suffix}: dtype {tensor.dtype}, the quantized layout needs {param.dtype}")
            try:
                param.weight_loader(param, tensor.to(param.device))
            except (RuntimeError, ModelLoadError) as e:
                raise ModelLoadError(f"{module}.{suffix}: {e}") from None
        return dequantized_weight(layer)                       # [out, in] float32
