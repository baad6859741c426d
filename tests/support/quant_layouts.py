"""The producer-made checkpoints of tests/fixtures/quant (tools/dev/make_quant_fixtures.py), a reference
dequantizer written from each format's description -- independent of engine.quant.layouts, which the tests
hold to it -- and the float32 twin of a fixture (every quantized linear dequantized by that reference).

Formats (W is [out, in] float32; see docs/quantization.md for the sources):
  ModelOpt FP8     weight e4m3 * weight_scale (a scalar)
  ModelOpt NVFP4   e2m1(nibbles of weight, even column low) * weight_scale (e4m3, per 16) * weight_scale_2
  ct float         weight e4m3 * weight_scale ([1], [out, 1] or 128x128 blocks)
  ct pack          (field(weight_packed, along in) - zp) * weight_scale[group]; zp = field(weight_zero_point,
                   along out) or 2^(bits-1)
  ct nvfp4         e2m1(weight_packed) * weight_scale / weight_global_scale
  GPTQ             (field(qweight, along in) - z) * scales, z = field(qzeros, along out) (+1 for format v1)
  AWQ GEMM         the same with both packed along out in the nibble order 0 2 4 6 1 3 5 7
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quant"
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def manifest() -> dict:
    return json.loads((FIXTURES / "MANIFEST.json").read_text())


def fixture_names() -> list[str]:
    return sorted(manifest()["fixtures"])


def tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        if f.name != "producer_probe.safetensors":
            out.update(load_file(str(f)))
    return out


def quant_config(d: Path) -> dict:
    qc = json.loads((d / "config.json").read_text()).get("quantization_config")
    if qc is None and (d / "hf_quant_config.json").exists():
        qc = {"quant_method": "modelopt", **json.loads((d / "hf_quant_config.json").read_text())["quantization"]}
    return qc


def fields(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The unsigned bits-wide fields of int32 words along dim, least significant first."""
    w = words.to(torch.int64).movedim(dim, -1) & 0xFFFFFFFF
    n = 32 // bits
    parts = [(w >> (bits * j)) & ((1 << bits) - 1) for j in range(n)]
    return torch.stack(parts, -1).flatten(-2).movedim(-1, dim)


def _e2m1(packed: torch.Tensor) -> torch.Tensor:
    p = packed.to(torch.int64)
    return E2M1[torch.stack([p & 15, p >> 4], -1).flatten(-2)]


def _expand(scale: torch.Tensor, out: int, inp: int) -> torch.Tensor:
    """A scale of any granularity ([] / [1], [out, 1], [out, groups], blocks) over [out, in]."""
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(out, inp)
    rows, cols = -(-out // s.shape[0]), -(-inp // s.shape[1])
    return s.repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)[:, :inp]


def reference_dense(d: Path) -> dict[str, torch.Tensor]:
    """module -> float32 W [out, in] of every quantized linear of checkpoint `d`."""
    qc, t = quant_config(d), tensors(d)
    method, out = qc["quant_method"], {}
    if method == "gptq" or method == "awq":
        bits = qc.get("bits", 4)
        v1 = method == "gptq" and (qc.get("checkpoint_format") or qc.get("format") or "gptq") == "gptq"
        for name in t:
            if not name.endswith(".qweight"):
                continue
            m = name[:-len(".qweight")]
            scales = t[m + ".scales"].float()                                     # [groups, out]
            if method == "gptq":
                q = fields(t[name], bits, 0)                                      # [in, out]
                z = fields(t[m + ".qzeros"], bits, 1) + (1 if v1 else 0)          # [groups, out]
                g = t[m + ".g_idx"].long() if m + ".g_idx" in t else torch.arange(q.shape[0]) // qc["group_size"]
            else:
                order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])                    # column c in nibble order[c % 8]
                def awq(x):
                    f = fields(x, 4, 1)
                    return f.view(f.shape[0], -1, 8)[:, :, order].reshape(f.shape)
                q, z = awq(t[name]), awq(t[m + ".qzeros"])
                g = torch.arange(q.shape[0]) // qc.get("group_size", qc.get("q_group_size"))
            out[m] = ((q - z[g]).float() * scales[g]).t().contiguous()
        return out
    for name in t:
        if not name.endswith(".weight_scale"):
            continue
        m = name[:-len(".weight_scale")]
        scale = t[name]
        if m + ".weight_scale_2" in t:                                            # ModelOpt NVFP4
            v = _e2m1(t[m + ".weight"])
            out[m] = v * _expand(scale, *v.shape) * t[m + ".weight_scale_2"].float().reshape(())
        elif m + ".weight_global_scale" in t:                                     # ct NVFP4
            v = _e2m1(t[m + ".weight_packed"])
            out[m] = v * _expand(scale, *v.shape) / t[m + ".weight_global_scale"].float().reshape(())
        elif m + ".weight_packed" in t:                                           # ct pack-quantized
            group = next(iter(qc["config_groups"].values()))["weights"]
            bits = group["num_bits"]
            q = fields(t[m + ".weight_packed"], bits, 1)
            o, i = q.shape
            zp = (fields(t[m + ".weight_zero_point"], bits, 0)[:o] if m + ".weight_zero_point" in t
                  else torch.full((o, scale.shape[1]), 1 << (bits - 1)))
            out[m] = (q.float() - _expand(zp, o, i)) * _expand(scale, o, i)
        else:                                                                     # FP8 (ModelOpt, ct)
            w = t[m + ".weight"].float()
            out[m] = w * _expand(scale, *w.shape)
    return out


def dequantized_dir(src: Path, dst: Path) -> Path:
    """`src` as a float32 checkpoint without quantization_config: every quantized linear dequantized by
    `reference_dense`, every other tensor as stored (in float32)."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / f).exists():
            shutil.copy(src / f, dst / f)
    dense, t = reference_dense(src), tensors(src)
    quantized = set(dense)
    plain = {n: x.float() for n, x in t.items() if n.rpartition(".")[0] not in quantized}
    plain.update({f"{m}.weight": w for m, w in dense.items()})
    save_file(plain, str(dst / "model.safetensors"))
    return dst


def probe(d: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (positions int64 [n, 2], the producer's own dequantized values float32 [n])."""
    p = load_file(str(d / "producer_probe.safetensors"))
    return {n[:-len(".idx")]: (p[n].long(), p[n[:-len(".idx")] + ".val"]) for n in p if n.endswith(".idx")}
