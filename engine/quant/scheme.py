"""A checkpoint's quantization: its layout (engine.quant.layouts, read from the config), which linear layers it
quantizes (read from the tensors), and each layer's kind.

Config, as the producers write it (engine.quant.layouts has one module per family):
  ModelOpt (NVFP4, FP8): `hf_quant_config.json` {"quantization": {"quant_algo": ..., "exclude_modules": [...]}}
      or config.json `quantization_config` {"quant_method": "modelopt", "quant_algo": ..., "ignore": [...]}.
  Qwen FP8 blocks: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
      "weight_block_size": [128, 128]}, optional "modules_to_not_convert".
  compressed-tensors, GPTQ, AWQ: see their layout modules.

A linear layer is quantized when the checkpoint holds its marker tensor (`weight_scale`, `qweight`, ...).
The config's exclusions must agree (an excluded module may not carry one), and so must the fused parts
(q/k/v, gate/up: all quantized alike, or none).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from engine.errors import ModelLoadError
from engine.quant.layouts import FP8, NVFP4, Layout, LinearQuant, layout_from_hf
from engine.quant.layouts.base import ByPrefix, Unquantized

if TYPE_CHECKING:
    import torch

__all__ = ["FP8", "KEPT", "NVFP4", "QuantScheme", "canonical_weights", "check_header_dtypes", "from_hf",
           "from_hf_quant_config", "normalize_found", "quantized_shapes", "resolve_checkpoint"]

KEPT = ("model.embed_tokens.weight", "lm_head.weight")
# A mixture of experts' router and its shared expert's gate decide which weights run and how much of them
# counts: kept in the model dtype when quantizing everything else, as ModelOpt's and Qwen's releases keep them.
# Qwen3-Next's grouped DeltaNet input projections (`in_proj_qkvz`, `in_proj_ba`) are kept too: the loader
# permutes their rows into Qwen3.5's order (engine/models/qwen3_next.py); it reads them quantized too (row-wise
# layouts kept quantized, FP8 blocks dequantized at load), but in FP8 blocks -- this quantizer's -- nothing is saved.
KEPT_MODULES = (".mlp.gate", ".shared_expert_gate", ".in_proj_qkvz", ".in_proj_ba")


def _default_layout(fmt: str, exclude: tuple[str, ...]) -> Layout:
    from engine.quant.layouts.modelopt import ModelOptNVFP4, QwenFP8Blocks
    if fmt == NVFP4:
        return ModelOptNVFP4(exclude)
    if fmt == FP8:
        return QwenFP8Blocks(exclude)
    raise ModelLoadError(f"a quantization scheme of format {fmt!r} needs its checkpoint layout")


@dataclass(frozen=True)
class QuantScheme:
    format: str                                  # "nvfp4", "fp8", "modelopt_fp8", "compressed-tensors", "gptq", "awq"
    group_size: int = 16                         # NVFP4 values per E4M3 scale
    block: tuple[int, int] = (128, 128)          # FP8 weight block
    exclude: tuple[str, ...] = ()                # module names or patterns kept unquantized (nvfp4, fp8)
    # modules (checkpoint prefixes such as "model.layers.0.mlp.up_proj") the checkpoint quantizes;
    # None until read from the tensors (`resolve`)
    modules: frozenset[str] | None = None
    layout: Layout | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.layout is None:
            object.__setattr__(self, "layout", _default_layout(self.format, self.exclude))

    def excludes(self, module: str) -> bool:
        return self.layout.excluded_by(module) is not None

    def spec(self, module: str) -> LinearQuant:
        """The kind of the (quantized) checkpoint module `module`."""
        return self.layout.linear_quant(module).at(module)

    def resolve(self, names: Iterable[str]) -> "QuantScheme":
        """The scheme with its quantized modules read from the checkpoint's tensor names."""
        modules = {}
        for n in names:
            module, _, suffix = n.rpartition(".")
            if suffix in self.layout.markers:
                modules.setdefault(module, n)
        for m in sorted(modules):
            why = self.layout.excluded_by(m)
            if why is not None:
                raise ModelLoadError(f"{modules[m]}: the module is in {why} but carries quantized tensors")
        return replace(self, modules=frozenset(modules))

    def over_linears(self, shapes: dict[str, tuple[int, ...]]) -> "QuantScheme":
        """The scheme quantizing every linear layer of a bf16 checkpoint's `shapes` that it does not
        exclude (embeddings, lm_head, MoE routers, shared-expert gates and Qwen3-Next's grouped projections
        are never quantized)."""
        modules = frozenset(n[:-len(".weight")] for n, s in shapes.items()
                            if n.endswith(".weight") and len(s) == 2 and n not in KEPT
                            and not n[:-len(".weight")].endswith(KEPT_MODULES)
                            and not self.excludes(n[:-len(".weight")]))
        return replace(self, modules=modules)

    def layer_format(self, prefix: str, parts: list[str]) -> LinearQuant | None:
        """The kind of one (possibly fused) linear layer whose checkpoint parts are prefix.part, or None."""
        names = [f"{prefix}.{p}" if p else prefix for p in parts]
        quantized = [n in (self.modules or ()) for n in names]
        if any(quantized) and not all(quantized):
            mixed = ", ".join(f"{n} ({'quantized' if q else 'not'})" for n, q in zip(names, quantized))
            raise ModelLoadError(f"fused parts must all be quantized or none: {mixed}")
        if not all(quantized):
            return None
        specs = [self.spec(n) for n in names]
        if any(s != specs[0] for s in specs):
            shown = ", ".join(f"{s.module} ({s.kind}, {s.bits} bits, group {s.group_size})" for s in specs)
            raise ModelLoadError(f"fused parts must be quantized alike: {shown}")
        return specs[0]

    def to_hf(self) -> dict[str, Any]:
        """The config.json `quantization_config` of this scheme (the formats `ninfer quantize` writes)."""
        if self.format == NVFP4:
            return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": self.group_size,
                    "exclude_modules": list(self.exclude)}
        out = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
               "weight_block_size": list(self.block)}
        if self.exclude:
            out["modules_to_not_convert"] = list(self.exclude)
        return out


def from_hf(qc: dict[str, Any] | None) -> QuantScheme | None:
    """The scheme of a `quantization_config` (or hf_quant_config.json's "quantization"); None when absent."""
    if not qc:
        return None
    fmt, layout = layout_from_hf(qc)
    exclude = tuple(getattr(layout, "exclude", ()) or ())
    return QuantScheme(fmt, exclude=exclude, layout=layout)


def joined(base: QuantScheme | None, prefix: str, part: QuantScheme | None) -> QuantScheme | None:
    """`base` for every module but those under `prefix`, which follow `part` (the MTP head of another
    checkpoint, quantized in its own layout or not at all); None when neither is quantized."""
    if base is None and part is None:
        return None
    modules = {m for m in (base.modules or ()) if not m.startswith(prefix)} if base else set()
    modules |= {m for m in (part.modules or ()) if m.startswith(prefix)} if part else set()
    layout = ByPrefix(base.layout if base else Unquantized(), prefix, part.layout if part else Unquantized())
    return QuantScheme((base or part).format, exclude=(base or part).exclude, modules=frozenset(modules), layout=layout)


def from_hf_quant_config(doc: dict[str, Any]) -> dict[str, Any]:
    """ModelOpt's hf_quant_config.json as a config.json `quantization_config`."""
    q = doc.get("quantization")
    if not isinstance(q, dict):
        raise ModelLoadError("hf_quant_config.json: no \"quantization\" object")
    return {"quant_method": "modelopt", **q}


def quantized_shapes(shapes: dict[str, tuple[int, ...]], scheme: QuantScheme) -> dict[str, tuple[int, ...]]:
    """The tensors a checkpoint holds for `shapes` (bf16 names and shapes) once `scheme` quantizes
    its modules: each quantized `X.weight` [out, in] becomes its layout's tensors."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        module = name[:-len(".weight")] if name.endswith(".weight") else None
        if module is None or module not in (scheme.modules or ()):
            out[name] = shape
            continue
        rows, cols = shape
        out.update(scheme.layout.disk_shapes(module, scheme.spec(module), rows, cols))
    return out


def normalize_found(found: dict[str, tuple[int, ...]], scheme: QuantScheme | None) -> dict[str, tuple[int, ...]]:
    """Checkpoint shapes as `quantized_shapes` writes them: optional tensors of quantized modules dropped,
    one-value scales' shape [] or [1] read as []."""
    if scheme is None:
        return found
    layout, modules = scheme.layout, scheme.modules
    out = {}
    for name, shape in found.items():
        module, _, suffix = name.rpartition(".")
        if modules is not None and module not in modules:
            out[name] = tuple(shape)
        elif suffix in layout.optional:
            continue
        elif suffix in layout.scalars and tuple(shape) in ((), (1,)):
            out[name] = ()
        else:
            out[name] = tuple(shape)
    return out


def check_header_dtypes(dtypes: dict[str, str], scheme: QuantScheme) -> None:
    """Refuse, naming every tensor and field, a quantized module whose tensors have the wrong dtype."""
    wrong = []
    for module in sorted(scheme.modules or ()):
        for suffix, allowed in scheme.layout.dtypes_for(module, scheme.spec(module)).items():
            got = dtypes.get(f"{module}.{suffix}")
            if got is not None and got not in allowed:
                wrong.append(f"{module}.{suffix} is {got} (the {scheme.format} layout needs {' or '.join(allowed)})")
    if wrong:
        shown = "; ".join(wrong[:6]) + (f" and {len(wrong) - 6} more" if len(wrong) > 6 else "")
        raise ModelLoadError(f"unsupported {scheme.format} layout: {shown}")


def resolve_checkpoint(scheme: QuantScheme, weights) -> QuantScheme:
    """The scheme with the modules the checkpoint quantizes, its header dtypes checked where the
    weights can tell them (files on disk)."""
    resolved = scheme.resolve(weights.shapes())
    dtypes = getattr(weights, "dtypes", None)
    if dtypes is not None:
        check_header_dtypes(dtypes(), resolved)
    return resolved


def canonical_weights(weights: Iterable[tuple[str, torch.Tensor]],
                      scheme: QuantScheme | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors as the layers hold them: each tensor of a quantized module converted by its layout
    (repacked, transposed, a divisor inverted, an unused activation scale dropped); the rest as they are."""
    modules = (scheme.modules or frozenset()) if scheme is not None else frozenset()
    for name, tensor in weights:
        module, _, suffix = name.rpartition(".")
        if module not in modules:
            yield name, tensor
            continue
        for layer_suffix, converted in scheme.layout.convert(module, suffix, tensor, scheme.spec(module)):
            yield f"{module}.{layer_suffix}", converted
