"""What every checkpoint layout states, and the kinds of quantized linear layers the engine runs.

A layout (`Layout`) is one producer's way of storing quantized linear layers: which tensors mark a
module as quantized, the tensors (names, shapes, header dtypes) each quantized module must have on
disk, which modules its config keeps unquantized, and how each tensor becomes a tensor of the layer
(`convert`). The layer side has four kinds (`LinearQuant.kind`), one per family of kernels:

    fp8          e4m3 weight [out, in], float32 block scales (`weight_scale_inv`); per-tensor scales
                 load as blocks filled with the one value (exact: every block of a part has it)
    fp8_channel  e4m3 weight [out, in], float32 scale per output row (`weight_scale`)
    nvfp4        packed E2M1 [out, in/2], E4M3 group scales [out, in/16], float32 row scale (`weight_scale_2`)
    int          packed unsigned codes, group scales and zero points (engine.quant.int_formats)

Which modules are quantized is read from the tensors (a module carrying a marker tensor); the config's
exclusions must agree. Producers do not always record what they skipped (gptqmodel leaves the hybrid's
in_proj_a/b unquantized without a word), so the tensors decide.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.errors import ModelLoadError

if TYPE_CHECKING:                       # the config side imports no torch (`ninfer quantize`'s parser)
    import torch

FP8, FP8_CHANNEL, NVFP4, INT = "fp8", "fp8_channel", "nvfp4", "int"


@dataclass(frozen=True)
class LinearQuant:
    """How one linear layer is held and multiplied; fused parts (q/k/v, gate/up) must have equal ones."""

    kind: str                                  # FP8, FP8_CHANNEL, NVFP4 or INT
    bits: int = 0                              # INT: 4 or 8
    group_size: int = 0                        # INT: input columns per scale, 0 = one scale per row
    act_order: bool = False                    # INT: a g_idx assigns the columns to groups (GPTQ desc_act)
    module: str = field(default="", compare=False)   # a checkpoint module it stands for (messages only)

    def at(self, module: str) -> "LinearQuant":
        return LinearQuant(self.kind, self.bits, self.group_size, self.act_order, module)


class Layout:
    """One producer's layout of quantized linear layers (subclasses fill in the methods)."""

    name = ""                                  # for messages, e.g. "GPTQ (checkpoint_format gptq)"
    markers: tuple[str, ...] = ()              # tensor suffixes that mark a module as quantized
    scalars: tuple[str, ...] = ()              # suffixes of one-value scales: shapes [] and [1] read alike
    optional: tuple[str, ...] = ()             # suffixes accepted and not loaded (activation scales, ...)

    def excluded_by(self, module: str) -> str | None:
        """The config field that keeps `module` unquantized, or None."""
        return None

    def linear_quant(self, module: str) -> LinearQuant:
        raise NotImplementedError

    def disk_shapes(self, module: str, spec: LinearQuant, out: int, inp: int) -> dict[str, tuple[int, ...]]:
        """Every tensor a quantized module [out, in] must have on disk, by full name."""
        raise NotImplementedError

    def disk_dtypes(self, spec: LinearQuant) -> dict[str, tuple[str, ...]]:
        """Suffix -> the safetensors header dtypes it may have."""
        raise NotImplementedError

    def dtypes_for(self, module: str, spec: LinearQuant) -> dict[str, tuple[str, ...]]:
        return self.disk_dtypes(spec)

    def convert(self, module: str, suffix: str, tensor: torch.Tensor, spec: LinearQuant) -> list[tuple[str, torch.Tensor]]:
        """One checkpoint tensor of a quantized module as (layer tensor suffix, tensor) pairs (none: not loaded)."""
        raise NotImplementedError


def matches(module: str, pattern: str) -> bool:
    """A name in an exclusion or target list: the module itself, a prefix of it, an fnmatch pattern, or
    (compressed-tensors) `re:REGEX` matched from the start."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.startswith(pattern + ".") or fnmatch.fnmatchcase(module, pattern)


def require(qc: dict, key: str, allowed, default=None, what: str = ""):
    """qc[key] (or `default`), refused naming the field unless it is one of `allowed`."""
    value = qc.get(key, default)
    if value not in allowed:
        shown = ", ".join(repr(a) for a in allowed)
        raise ModelLoadError(f"quantization_config.{what}{key}={value!r} is not supported; supported: {shown}")
    return value


def per_rows(t: torch.Tensor) -> torch.Tensor:
    """A one-value scale as float32 [1]: the layer fills every row of its part with it."""
    return t.float().reshape(1)


class Unquantized(Layout):
    """A checkpoint without quantized layers (one side of `ByPrefix`)."""

    name = "unquantized"

    def excluded_by(self, module: str) -> str | None:
        return "an unquantized checkpoint"


class ByPrefix(Layout):
    """The modules under `prefix` in one layout (an MTP head read from another checkpoint), the rest in another."""

    def __init__(self, rest: Layout, prefix: str, part: Layout):
        self.rest, self.prefix, self.part = rest, prefix, part
        self.name = rest.name if not isinstance(rest, Unquantized) else part.name
        for attr in ("markers", "scalars", "optional"):
            setattr(self, attr, tuple(dict.fromkeys(getattr(rest, attr) + getattr(part, attr))))

    def of(self, module: str) -> Layout:
        return self.part if module.startswith(self.prefix) else self.rest

    def excluded_by(self, module):
        return self.of(module).excluded_by(module)

    def linear_quant(self, module):
        return self.of(module).linear_quant(module)

    def disk_shapes(self, module, spec, out, inp):
        return self.of(module).disk_shapes(module, spec, out, inp)

    def dtypes_for(self, module, spec):
        return self.of(module).dtypes_for(module, spec)

    def convert(self, module, suffix, tensor, spec):
        return self.of(module).convert(module, suffix, tensor, spec)


class Renamed(Layout):
    """`layout` with some modules loaded under other names (`aliases`: new name -> checkpoint module) whose
    tensors the model has already converted to the layer's (Qwen3-Next's grouped DeltaNet projections, their
    converted rows permuted into Qwen3.5's flat ones): an alias takes its checkpoint module's kind and
    exclusions, states no disk tensors of its own and passes its tensors through unconverted."""

    def __init__(self, layout: Layout, aliases: dict[str, str]):
        self.layout, self.aliases = layout, dict(aliases)
        self.name, self.markers, self.scalars, self.optional = layout.name, layout.markers, layout.scalars, layout.optional

    def excluded_by(self, module):
        return self.layout.excluded_by(self.aliases.get(module, module))

    def linear_quant(self, module):
        return self.layout.linear_quant(self.aliases.get(module, module))

    def disk_shapes(self, module, spec, out, inp):
        if module in self.aliases:
            return {f"{module}.weight": (out, inp)}         # stated by the model under the checkpoint's name
        return self.layout.disk_shapes(module, spec, out, inp)

    def dtypes_for(self, module, spec):
        return {} if module in self.aliases else self.layout.dtypes_for(module, spec)

    def convert(self, module, suffix, tensor, spec):
        if module in self.aliases:
            return [(suffix, tensor)]
        return self.layout.convert(module, suffix, tensor, spec)
