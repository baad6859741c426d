"""A checkpoint's quantization: which format, read from its config, and which linear layers use it.

Config, as the publishers write it:
  NVFP4 (ModelOpt): `hf_quant_config.json` {"quantization": {"quant_algo": "NVFP4", "group_size": 16,
      "exclude_modules": [...]}} or config.json `quantization_config` {"quant_method": "modelopt",
      "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": [...]}.
  FP8 (Qwen): config.json `quantization_config` {"quant_method": "fp8", "fmt": "e4m3",
      "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, optional "modules_to_not_convert".

Which layers are quantized is read from the tensors themselves: a linear layer is quantized when
the checkpoint holds its scale (`weight_scale` / `weight_scale_inv`). The exclusion list must agree
(a layer it excludes may not carry a scale), and so must the fused parts (q/k/v, gate/up).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, replace
from typing import Any

from engine.errors import ModelLoadError

NVFP4, FP8 = "nvfp4", "fp8"
# the tensors (besides `weight`) of one quantized linear layer, and the one that marks it
SCALE_NAMES = {NVFP4: ("weight_scale", "weight_scale_2"), FP8: ("weight_scale_inv",)}
OPTIONAL_NAMES = {NVFP4: ("input_scale",), FP8: ()}
# safetensors header dtypes each tensor must have
HEADER_DTYPES = {NVFP4: {"weight": "U8", "weight_scale": "F8_E4M3", "weight_scale_2": "F32", "input_scale": "F32"},
                 FP8: {"weight": "F8_E4M3", "weight_scale_inv": "F32"}}


KEPT = ("model.embed_tokens.weight", "lm_head.weight")
# A mixture of experts' router and its shared expert's gate decide which weights run and how much of them
# counts: kept in the model dtype when quantizing everything else, as ModelOpt's and Qwen's releases keep them.
# Qwen3-Next's grouped DeltaNet input projections (`in_proj_qkvz`, `in_proj_ba`) are kept too: the loader
# permutes their rows into Qwen3.5's order (engine/models/qwen3_next.py) and refuses them quantized.
KEPT_MODULES = (".mlp.gate", ".shared_expert_gate", ".in_proj_qkvz", ".in_proj_ba")


@dataclass(frozen=True)
class QuantScheme:
    format: str                                  # "nvfp4" or "fp8"
    group_size: int = 16                         # NVFP4 values per E4M3 scale
    block: tuple[int, int] = (128, 128)          # FP8 weight block
    exclude: tuple[str, ...] = ()                # module names or patterns kept unquantized
    # modules (checkpoint prefixes such as "model.layers.0.mlp.up_proj") the checkpoint quantizes;
    # None until read from the tensors (`resolve`)
    modules: frozenset[str] | None = None

    @property
    def marker(self) -> str:
        return SCALE_NAMES[self.format][0]

    def excludes(self, module: str) -> bool:
        return any(module == p or module.startswith(p + ".") or fnmatch.fnmatchcase(module, p) for p in self.exclude)

    def resolve(self, names) -> "QuantScheme":
        """The scheme with its quantized modules read from the checkpoint's tensor names."""
        suffix = "." + self.marker
        modules = frozenset(n[:-len(suffix)] for n in names if n.endswith(suffix))
        for m in sorted(modules):
            if self.excludes(m):
                raise ModelLoadError(f"{m}.{self.marker}: the module is in exclude_modules but carries a scale")
        return replace(self, modules=modules)

    def over_linears(self, shapes: dict[str, tuple[int, ...]]) -> "QuantScheme":
        """The scheme quantizing every linear layer of a bf16 checkpoint's `shapes` that it does not
        exclude (embeddings, lm_head, MoE routers, shared-expert gates and Qwen3-Next's grouped projections
        are never quantized)."""
        modules = frozenset(n[:-len(".weight")] for n, s in shapes.items()
                            if n.endswith(".weight") and len(s) == 2 and n not in KEPT
                            and not n[:-len(".weight")].endswith(KEPT_MODULES)
                            and not self.excludes(n[:-len(".weight")]))
        return replace(self, modules=modules)

    def layer_format(self, prefix: str, parts: list[str]) -> str | None:
        """The format of one (possibly fused) linear layer whose checkpoint parts are prefix.part."""
        names = [f"{prefix}.{p}" if p else prefix for p in parts]
        quantized = [n in (self.modules or ()) for n in names]
        if any(quantized) and not all(quantized):
            mixed = ", ".join(f"{n} ({'quantized' if q else 'not'})" for n, q in zip(names, quantized))
            raise ModelLoadError(f"fused parts must all be quantized or none: {mixed}")
        return self.format if all(quantized) else None

    def to_hf(self) -> dict[str, Any]:
        """The config.json `quantization_config` of this scheme."""
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
    method = str(qc.get("quant_method", "")).lower()
    algo = qc.get("quant_algo")
    if algo is not None or method == "modelopt":
        if str(algo).upper() != "NVFP4":
            raise ModelLoadError(f"quantization_config.quant_algo={algo!r} is not supported; supported: NVFP4")
        group = qc.get("group_size", 16)
        if group != 16:
            raise ModelLoadError(f"quantization_config.group_size={group} is not supported; NVFP4 needs 16")
        if qc.get("kv_cache_quant_algo") not in (None, "none", "None"):
            raise ModelLoadError(f"quantization_config.kv_cache_quant_algo={qc['kv_cache_quant_algo']!r} is not "
                                 "supported (KV scales from the checkpoint); use kv_dtype=int8 instead")
        return QuantScheme(NVFP4, group_size=16, exclude=tuple(qc.get("exclude_modules") or ()))
    if method == "fp8":
        block = qc.get("weight_block_size")
        if list(block or ()) != [128, 128]:
            raise ModelLoadError(f"quantization_config.weight_block_size={block!r} is not supported; FP8 needs [128, 128]")
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ModelLoadError(f"quantization_config.fmt={fmt!r} is not supported; FP8 needs e4m3")
        act = qc.get("activation_scheme", "dynamic")
        if act != "dynamic":
            raise ModelLoadError(f"quantization_config.activation_scheme={act!r} is not supported; FP8 needs dynamic")
        return QuantScheme(FP8, block=(128, 128), exclude=tuple(qc.get("modules_to_not_convert") or ()))
    raise ModelLoadError(f"quantization_config.quant_method={method!r} is not supported; supported: fp8, modelopt (NVFP4)")


def from_hf_quant_config(doc: dict[str, Any]) -> dict[str, Any]:
    """ModelOpt's hf_quant_config.json as a config.json `quantization_config`."""
    q = doc.get("quantization")
    if not isinstance(q, dict):
        raise ModelLoadError("hf_quant_config.json: no \"quantization\" object")
    return {"quant_method": "modelopt", **q}


def quantized_shapes(shapes: dict[str, tuple[int, ...]], scheme: QuantScheme) -> dict[str, tuple[int, ...]]:
    """The tensors a checkpoint holds for `shapes` (bf16 names and shapes) once `scheme` quantizes
    its modules: each quantized `X.weight` [out, in] becomes the format's tensors."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        module = name[:-len(".weight")] if name.endswith(".weight") else None
        if module is None or module not in (scheme.modules or ()):
            out[name] = shape
            continue
        rows, cols = shape
        if scheme.format == NVFP4:
            if cols % scheme.group_size:
                raise ModelLoadError(f"{name}: in_features {cols} is not a multiple of group_size {scheme.group_size}")
            out.update({name: (rows, cols // 2), f"{module}.weight_scale": (rows, cols // scheme.group_size),
                        f"{module}.weight_scale_2": ()})
        else:
            br, bc = scheme.block
            out.update({name: shape, f"{module}.weight_scale_inv": (-(-rows // br), -(-cols // bc))})
    return out


def normalize_found(found: dict[str, tuple[int, ...]], scheme: QuantScheme | None) -> dict[str, tuple[int, ...]]:
    """Checkpoint shapes as `quantized_shapes` writes them: optional tensors dropped, the scalar
    scales' shape [] or [1] read as []."""
    if scheme is None:
        return found
    optional = tuple("." + n for n in OPTIONAL_NAMES[scheme.format])
    out = {}
    for name, shape in found.items():
        if name.endswith(optional):
            continue
        out[name] = () if name.endswith(".weight_scale_2") and tuple(shape) in ((), (1,)) else tuple(shape)
    return out


def check_header_dtypes(dtypes: dict[str, str], scheme: QuantScheme) -> None:
    """Refuse, naming every tensor and field, a quantized module whose tensors have the wrong dtype."""
    wanted = HEADER_DTYPES[scheme.format]
    wrong = []
    for module in sorted(scheme.modules or ()):
        for field, dtype in wanted.items():
            got = dtypes.get(f"{module}.{field}")
            if got is not None and got != dtype:
                wrong.append(f"{module}.{field} is {got} (the {scheme.format} layout needs {dtype})")
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
