"""Checkpoint layouts of quantized linear layers, one module per producer family (see base.py)."""

from __future__ import annotations

from typing import Any

from engine.errors import ModelLoadError
from engine.quant.layouts.base import FP8, FP8_CHANNEL, INT, NVFP4, Layout, LinearQuant

__all__ = ["FP8", "FP8_CHANNEL", "INT", "NVFP4", "Layout", "LinearQuant", "layout_from_hf"]

METHODS = ("fp8", "modelopt (FP8, NVFP4)", "compressed-tensors", "gptq", "awq")


def layout_from_hf(qc: dict[str, Any]) -> tuple[str, Layout]:
    """(format name, layout) of a config.json `quantization_config` (or hf_quant_config.json's
    "quantization"), every field it does not serve refused by name."""
    from engine.quant.layouts.compressed_tensors import CompressedTensors
    from engine.quant.layouts.gptq_awq import AWQ, GPTQ
    from engine.quant.layouts.modelopt import ModelOptFP8, ModelOptNVFP4, QwenFP8Blocks
    method = str(qc.get("quant_method", "")).lower()
    algo = qc.get("quant_algo")
    if algo is not None or method == "modelopt":
        algo = str(algo).upper()
        if algo not in ("NVFP4", "FP8"):
            raise ModelLoadError(f"quantization_config.quant_algo={qc.get('quant_algo')!r} is not supported; "
                                 "supported: FP8, NVFP4")
        if qc.get("kv_cache_quant_algo") not in (None, "none", "None"):
            raise ModelLoadError(f"quantization_config.kv_cache_quant_algo={qc['kv_cache_quant_algo']!r} is not "
                                 "supported (KV scales from the checkpoint); use kv_dtype=int8 instead")
        field = "exclude_modules" if "exclude_modules" in qc else "ignore"
        exclude = tuple(qc.get(field) or ())
        if algo == "FP8":
            return "modelopt_fp8", ModelOptFP8(exclude, field)
        weights = ((qc.get("config_groups") or {}).get("group_0") or {}).get("weights") or {}
        group = qc.get("group_size", weights.get("group_size", 16))
        if group != 16:
            raise ModelLoadError(f"quantization_config.group_size={group} is not supported; NVFP4 needs 16")
        return "nvfp4", ModelOptNVFP4(exclude, field)
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
        return "fp8", QwenFP8Blocks(tuple(qc.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        return "compressed-tensors", CompressedTensors(qc)
    if method == "gptq":
        return "gptq", GPTQ(qc)
    if method == "awq":
        return "awq", AWQ(qc)
    raise ModelLoadError(f"quantization_config.quant_method={method!r} is not supported; supported: {', '.join(METHODS)}")
