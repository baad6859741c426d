"""Native GPTQ (`quant_method: gptq`: AutoGPTQ, GPTQModel, optimum) and AWQ GEMM (`quant_method: awq`: AutoAWQ,
GPTQModel), as their producers write them. Shapes for one linear [out, in], `groups` = in / group_size
(1 for group_size -1):

GPTQ:  qweight int32 [in*bits/32, out], packed along the INPUT dim, unsigned codes u
       qzeros  int32 [groups, out*bits/32], packed along the OUTPUT dim
       scales  fp16 (or bf16) [groups, out]
       g_idx   int32 [in]: the group of each input row; arange(in) // group_size unless desc_act
       W[o, i] = scales[g, o] * (u[i, o] - z[g, o]), g = g_idx[i]; checkpoint_format "gptq" (v1, the default)
       stores z - 1 in qzeros, "gptq_v2" stores z. With desc_act the rows stay in input order.
AWQ GEMM: qweight int32 [in, out/8] and qzeros int32 [groups, out/8], both packed along the OUTPUT dim
       with nibble j of a word holding column AWQ_ORDER[j] of its 8; scales [groups, out]; z stored as is.
       AWQ's activation scaling is folded into the previous norm or linear by the producer: no extra tensor.

Neither producer records the modules it skipped (gptqmodel leaves a hybrid's in_proj_a/b in bf16 without a
`dynamic` entry): a module is quantized when its qweight is present. Both become the int kind of
engine.quant.int_formats (codes repacked along the input dim, scales and zero points transposed to rows).
"""

from __future__ import annotations

import torch

from engine.errors import ModelLoadError
from engine.quant.int_formats import pack_factor, pack_int32, unpack_awq_cols, unpack_int32
from engine.quant.layouts.base import INT, Layout, LinearQuant, matches, require

INT_SCALES = ("F16", "BF16", "F32")


class _Packed(Layout):
    markers = ("qweight",)

    def __init__(self, bits: int, group_size: int, exclude: tuple[str, ...]):
        self.bits, self.group_size, self.exclude = bits, group_size, exclude

    def excluded_by(self, module: str) -> str | None:
        if any(matches(module, p) for p in self.exclude):
            return "quantization_config.modules_to_not_convert"
        return None

    def _groups(self, module: str, inp: int) -> int:
        gs = self.group_size
        if inp % pack_factor(self.bits) or (gs and inp % gs):
            raise ModelLoadError(f"{module}.qweight: in_features {inp} is not a multiple of group_size {gs} "
                                 f"and of {pack_factor(self.bits)} ({self.bits}-bit fields in int32 words)")
        return inp // gs if gs else 1


def _group_size(qc: dict, key: str) -> int:
    gs = qc.get(key, 128)
    if not isinstance(gs, int) or isinstance(gs, bool) or (gs <= 0 and gs != -1):
        raise ModelLoadError(f"quantization_config.{key}={gs!r} is not supported; supported: a positive integer or -1")
    return 0 if gs == -1 else gs


class GPTQ(_Packed):
    def __init__(self, qc: dict):
        bits = require(qc, "bits", (4, 8))
        fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
        key = "checkpoint_format" if qc.get("checkpoint_format") else "format"
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelLoadError(f"quantization_config.{key}={fmt!r} is not supported; supported: 'gptq', 'gptq_v2'")
        require(qc, "pack_dtype", ("int32",), "int32")
        require(qc, "lm_head", (False, None), False)
        dynamic = qc.get("dynamic") or {}
        if any(not str(k).startswith("-:") for k in dynamic):
            raise ModelLoadError("quantization_config.dynamic sets per-module bits or groups "
                                 f"({', '.join(str(k) for k in dynamic)}); only exclusions ('-:' patterns) are supported")
        exclude = tuple(qc.get("modules_to_not_convert") or ()) + tuple("re:" + str(k)[2:] for k in dynamic)
        super().__init__(bits, _group_size(qc, "group_size"), exclude)
        self.v1 = fmt == "gptq"
        self.act_order = bool(qc.get("desc_act", False))
        self.name = f"GPTQ ({key} {fmt})"
        # without desc_act, g_idx (when written) must be the plain arange(in) // group_size and is not loaded
        self.optional = () if self.act_order else ("g_idx",)

    def linear_quant(self, module: str) -> LinearQuant:
        return LinearQuant(INT, self.bits, self.group_size, self.act_order)

    def disk_shapes(self, module, spec, out, inp):
        m, per, groups = module, pack_factor(self.bits), self._groups(module, inp)
        if out % per:
            raise ModelLoadError(f"{m}.qzeros: out_features {out} is not a multiple of {per}")
        shapes = {f"{m}.qweight": (inp // per, out), f"{m}.qzeros": (groups, out // per), f"{m}.scales": (groups, out)}
        if self.act_order:
            shapes[f"{m}.g_idx"] = (inp,)
        return shapes

    def disk_dtypes(self, spec):
        return {"qweight": ("I32",), "qzeros": ("I32",), "scales": INT_SCALES, "g_idx": ("I32", "I64")}

    def convert(self, module, suffix, tensor, spec):
        if suffix == "qweight":                      # [in/per, out] -> u [in, out] -> [out, in/per]
            return [("qweight", pack_int32(unpack_int32(tensor, self.bits, 0).t(), self.bits, 1))]
        if suffix == "qzeros":                       # [groups, out/per] -> z [out, groups]
            z = unpack_int32(tensor, self.bits, 1).float() + (1.0 if self.v1 else 0.0)
            return [("zeros", z.t().contiguous())]
        if suffix == "scales":
            return [("scales", tensor.float().t().contiguous())]
        if suffix == "g_idx":
            if self.act_order:
                return [("g_idx", tensor.int())]
            gs = self.group_size or tensor.numel()
            if not torch.equal(tensor.long(), torch.arange(tensor.numel()) // gs):
                raise ModelLoadError(f"{module}.g_idx: the groups are permuted but quantization_config.desc_act is false")
            return []
        raise ModelLoadError(f"{module}.{suffix}: not a tensor of the GPTQ layout")


class AWQ(_Packed):
    name = "AWQ GEMM"

    def __init__(self, qc: dict):
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelLoadError(f"quantization_config.version={qc.get('version')!r} is not supported; supported: 'gemm'")
        bits = qc.get("bits", qc.get("w_bit", 4))
        if bits != 4:
            raise ModelLoadError(f"quantization_config.bits={bits!r} is not supported; AWQ GEMM packs 4-bit codes")
        super().__init__(4, _group_size(qc, "group_size" if "group_size" in qc else "q_group_size"),
                         tuple(qc.get("modules_to_not_convert") or ()))

    def linear_quant(self, module: str) -> LinearQuant:
        return LinearQuant(INT, 4, self.group_size)

    def disk_shapes(self, module, spec, out, inp):
        m, groups = module, self._groups(module, inp)
        if out % 8:
            raise ModelLoadError(f"{m}.qweight: out_features {out} is not a multiple of 8")
        return {f"{m}.qweight": (inp, out // 8), f"{m}.qzeros": (groups, out // 8), f"{m}.scales": (groups, out)}

    def disk_dtypes(self, spec):
        return {"qweight": ("I32",), "qzeros": ("I32",), "scales": INT_SCALES}

    def convert(self, module, suffix, tensor, spec):
        if suffix == "qweight":                      # [in, out/8] -> u [in, out] -> [out, in/8]
            return [("qweight", pack_int32(unpack_awq_cols(tensor).t(), 4, 1))]
        if suffix == "qzeros":
            return [("zeros", unpack_awq_cols(tensor).float().t().contiguous())]
        if suffix == "scales":
            return [("scales", tensor.float().t().contiguous())]
        raise ModelLoadError(f"{module}.{suffix}: not a tensor of the AWQ layout")
