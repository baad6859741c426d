#!/usr/bin/env python3
"""Regenerate tests/fixtures/quant: tiny Qwen3 / Qwen3.5 checkpoints quantized by the real producers.

    tools/dev/quant_fixture_venvs.sh VENVS          # once: one venv per producer (~7 min, ~7 GB)
    .venv/bin/python tools/dev/make_quant_fixtures.py --venvs VENVS            # every fixture
    .venv/bin/python tools/dev/make_quant_fixtures.py --venvs VENVS --only gptq

The driver runs in ninfer's own venv (it writes the seeded bf16 base models with transformers and the
embedded byte-level tokenizer); each producer runs in its own venv, because llmcompressor 0.14 pins
transformers <= 5.17 while the others run on 5.24:

    main    nvidia-modelopt 0.47.0 (mtq.quantize + export_hf_checkpoint)
    llmc    llmcompressor 0.14.0.1, compressed-tensors 0.19.0, transformers 5.17.0
    gptq    gptqmodel 7.6.0 (GPTQ v1 and AWQ GEMM), optimum 2.3.0 (transformers GPTQConfig: GPTQ v2)
    legacy  autoawq 0.2.9

No producer code is copied here: each producer is called through its public API. After writing a
fixture, the same venv dequantizes it with the producer's OWN dequantizer and stores the values at 128
seeded positions of every quantized linear in `producer_probe.safetensors` (`<module>.idx` int32
[128, 2] row/column, `<module>.val` float32 [128]); the tests hold ninfer's loader to those values.
MANIFEST.json lists every fixture: producer, versions, options, dequantizer, and the sha256 of each file.

Base models (made for each run and removed after it; seed 0, bf16, tied embeddings, the embedded tokenizer: vocab 384): hidden 128, intermediate
256, 4 query heads and 2 KV heads of 64, two layers (Qwen3.5: linear then full attention; linear
attention with 2 key and 4 value heads of 64), and one MTP layer (`mtp.*`, random) that each producer
keeps or drops as it does on real checkpoints. Every quantized dimension is a multiple of the group
sizes used (32, 64, 128), and with TP=2 the row-parallel inputs (o_proj 256 -> 128, down_proj 256 -> 128,
out_proj 256 -> 128) are still whole groups. The MoE fixtures (qwen3_moe, qwen3_next) take tests/support/moe.py's
tiny shapes (hidden 64, 8 experts of 32, top 2; Qwen3-Next's shared expert 64) in bf16 with tied embeddings and
no MTP layer; their compressed-tensors probes call the format's compressor on each module's tensors.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
FIX = os.path.join(REPO, "tests", "fixtures", "quant")
PROBES = 128

# name -> (venv, producer, arch, options)
HYBRID_IGNORE = ["lm_head", "re:.*linear_attn\\.in_proj_a$", "re:.*linear_attn\\.in_proj_b$"]
W8_ASYM = {"group_0": {"targets": ["Linear"], "weights": {
    "num_bits": 8, "type": "int", "symmetric": False, "strategy": "group", "group_size": 128}}}
W4_ASYM_G64 = {"group_0": {"targets": ["Linear"], "weights": {
    "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 64}}}
# mixtures of experts (tests/support/moe.py's tiny configs, bf16, tied embeddings, no MTP): routers and
# shared-expert gates ignored as the producers' Qwen3-MoE / Qwen3-Next examples do; Qwen3-Next's grouped
# DeltaNet input projections left to the recipe's "Linear" target (quantized)
MOE_IGNORE = ["lm_head", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$"]
W4_G16 = {"group_0": {"targets": ["Linear"], "weights": {
    "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}}}
FIXTURES = {
    "modelopt_fp8/qwen3": ("main", "modelopt", "qwen3", {"cfg": "FP8_DEFAULT_CFG"}),
    "modelopt_fp8/qwen3_5": ("main", "modelopt", "qwen3_5", {"cfg": "FP8_DEFAULT_CFG"}),
    "modelopt_nvfp4/qwen3": ("main", "modelopt", "qwen3", {"cfg": "NVFP4_DEFAULT_CFG"}),
    "ct_fp8_dynamic/qwen3": ("llmc", "llmc", "qwen3", {"scheme": "FP8_DYNAMIC"}),
    "ct_fp8_dynamic/qwen3_5": ("llmc", "llmc", "qwen3_5", {"scheme": "FP8_DYNAMIC"}),
    "ct_fp8_static/qwen3": ("llmc", "llmc", "qwen3", {"scheme": "FP8"}),
    "ct_fp8_block/qwen3": ("llmc", "llmc", "qwen3", {"scheme": "FP8_BLOCK"}),
    "ct_w4a16_sym/qwen3": ("llmc", "llmc", "qwen3", {"scheme": "W4A16"}),
    "ct_w4a16_sym/qwen3_5": ("llmc", "llmc", "qwen3_5", {"scheme": "W4A16", "ignore": HYBRID_IGNORE}),
    "ct_w4a16_asym_g64/qwen3": ("llmc", "llmc", "qwen3", {"config_groups": W4_ASYM_G64}),
    "ct_w8a16_asym/qwen3": ("llmc", "llmc", "qwen3", {"config_groups": W8_ASYM}),
    "ct_nvfp4/qwen3": ("llmc", "llmc", "qwen3", {"scheme": "NVFP4"}),
    "gptq_int4_sym/qwen3": ("gptq", "gptqmodel", "qwen3", {"bits": 4, "group_size": 128, "desc_act": False, "sym": True}),
    "gptq_int4_sym/qwen3_5": ("gptq", "gptqmodel", "qwen3_5", {"bits": 4, "group_size": 128, "desc_act": False, "sym": True}),
    "gptq_int4_asym_descact_g32/qwen3": ("gptq", "gptqmodel", "qwen3", {"bits": 4, "group_size": 32, "desc_act": True, "sym": False}),
    "gptq_int8_sym_descact_g64/qwen3": ("gptq", "gptqmodel", "qwen3", {"bits": 8, "group_size": 64, "desc_act": True, "sym": True}),
    "gptq_int8_asym/qwen3": ("gptq", "gptqmodel", "qwen3", {"bits": 8, "group_size": 128, "desc_act": False, "sym": False}),
    "gptq_v2_int4_sym/qwen3": ("gptq", "hf_optimum", "qwen3", {"bits": 4, "group_size": 128, "desc_act": False, "sym": True}),
    "awq_gemm_autoawq/qwen3": ("legacy", "autoawq", "qwen3", {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}),
    "awq_gemm_g64/qwen3": ("gptq", "gptqmodel", "qwen3", {"quant_method": "awq", "format": "gemm", "bits": 4, "group_size": 64, "sym": False, "_dtype": "float16"}),
    "awq_gemm/qwen3_5": ("gptq", "gptqmodel", "qwen3_5", {"quant_method": "awq", "format": "gemm", "bits": 4, "group_size": 128, "sym": False, "_dtype": "float16"}),
    "modelopt_nvfp4/qwen3_moe": ("main", "modelopt", "qwen3_moe", {"cfg": "NVFP4_DEFAULT_CFG"}),
    "modelopt_nvfp4/qwen3_next": ("main", "modelopt", "qwen3_next", {"cfg": "NVFP4_DEFAULT_CFG"}),
    "ct_w4a16_g16/qwen3_moe": ("llmc", "llmc", "qwen3_moe", {"config_groups": W4_G16, "ignore": MOE_IGNORE}),
    "ct_w4a16_g16/qwen3_next": ("llmc", "llmc", "qwen3_next", {"config_groups": W4_G16, "ignore": MOE_IGNORE}),
    "ct_fp8_dynamic/qwen3_next": ("llmc", "llmc", "qwen3_next", {"scheme": "FP8_DYNAMIC", "ignore": MOE_IGNORE}),
}
MOE_ARCHS = ("qwen3_moe", "qwen3_next")
# `--quality-out`: each layout from its real producer on the shared trained models (tools/quality/quant_quality.py
# measures them), calibrated on in-domain text (tools/quality/calibration_texts.py); not kept in the repository
G128 = {"bits": 4, "group_size": 128}
HYBRID_QUALITY = ("modelopt_fp8", "ct_fp8_dynamic", "ct_w4a16", "ct_nvfp4", "gptq_int4", "awq_gemm")
QUALITY = {f"{fmt}/{arch}": (venv, prod, arch, opts) for arch in ("qwen3", "qwen3_5") for fmt, (venv, prod, opts) in {
    "modelopt_fp8": ("main", "modelopt", {"cfg": "FP8_DEFAULT_CFG"}),
    "modelopt_nvfp4": ("main", "modelopt", {"cfg": "NVFP4_DEFAULT_CFG"}),
    "ct_fp8_dynamic": ("llmc", "llmc", {"scheme": "FP8_DYNAMIC"}),
    "ct_fp8_static": ("llmc", "llmc", {"scheme": "FP8"}),
    "ct_fp8_block": ("llmc", "llmc", {"scheme": "FP8_BLOCK"}),
    "ct_w8a16": ("llmc", "llmc", {"scheme": "W8A16"}),
    "ct_w4a16": ("llmc", "llmc", {"scheme": "W4A16"}),
    "ct_w4a16_asym": ("llmc", "llmc", {"scheme": "W4A16_ASYM"}),
    "ct_w4a16_gptq": ("llmc", "llmc", {"scheme": "W4A16", "algo": "gptq"}),
    "ct_nvfp4": ("llmc", "llmc", {"scheme": "NVFP4"}),
    "gptq_int4": ("gptq", "gptqmodel", {**G128, "desc_act": False, "sym": True}),
    "gptq_int4_descact": ("gptq", "gptqmodel", {**G128, "desc_act": True, "sym": False}),
    "gptq_int8": ("gptq", "gptqmodel", {"bits": 8, "group_size": 128, "desc_act": False, "sym": True}),
    "awq_gemm": ("gptq", "gptqmodel", {"quant_method": "awq", "format": "gemm", **G128, "sym": False,
                                       "_dtype": "float16"}),
    "awq_autoawq": ("legacy", "autoawq", {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}),
}.items() if arch == "qwen3" or fmt in HYBRID_QUALITY}
# the hybrid: one layout of each producer family (AutoAWQ has no Qwen3.5 model map)
TABLE = {**FIXTURES, **QUALITY}
VERSIONS = {"main": ["nvidia-modelopt", "torch", "transformers"],
            "llmc": ["llmcompressor", "compressed-tensors", "torch", "transformers"],
            "gptq": ["gptqmodel", "optimum", "torch", "transformers"],
            "legacy": ["autoawq", "torch", "transformers"]}

# -- base models (driver, ninfer's venv) --------------------------------------------------------------

COMMON = dict(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-6,
              tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0, mtp_num_hidden_layers=1)


def build_base(arch: str, out: str) -> None:
    import torch
    if arch in MOE_ARCHS:
        from tests.support.moe import build_reference, write_checkpoint
        from engine.loading.embedded_model import build_default_tokenizer
        # a shared expert of 64 (Qwen3-Next): NVFP4 groups of 16 must tile each rank's 32 columns at TP=2
        shared = {"shared_expert_intermediate_size": 64} if arch == "qwen3_next" else {}
        model, _ = build_reference(arch, seed=0, tie_word_embeddings=True, **shared)
        write_checkpoint(model.to(torch.bfloat16), {}, Path(out), "transformers", with_mtp=False)
        write_tokenizer(out, build_default_tokenizer())
        return
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    from engine.loading.embedded_model import build_default_tokenizer
    torch.manual_seed(0)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**COMMON, rope_theta=1e6, architectures=["Qwen3ForCausalLM"]))
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(
            **COMMON, layer_types=["linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
            linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
            linear_num_value_heads=4, architectures=["Qwen3_5ForCausalLM"]))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):       # zero-centred norms init to 0: perturb so "(1 + w)" matters
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.to(torch.bfloat16).save_pretrained(out)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    tensors.update(mtp_tensors(arch, gen))
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(out, build_default_tokenizer())


def mtp_tensors(arch: str, gen) -> dict:
    """A random MTP layer in the layout of ../shared/models (transformers does not know `mtp.*`)."""
    import torch
    h, f, d = COMMON["hidden_size"], COMMON["intermediate_size"], COMMON["head_dim"]
    q, kv = COMMON["num_attention_heads"] * d, COMMON["num_key_value_heads"] * d
    shapes = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,),
              "mtp.norm.weight": (h,)}
    p = "mtp.layers.0"
    shapes.update({f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                   f"{p}.self_attn.q_proj.weight": ((2 if arch == "qwen3_5" else 1) * q, h),
                   f"{p}.self_attn.k_proj.weight": (kv, h), f"{p}.self_attn.v_proj.weight": (kv, h),
                   f"{p}.self_attn.o_proj.weight": (h, q), f"{p}.self_attn.q_norm.weight": (d,),
                   f"{p}.self_attn.k_norm.weight": (d,), f"{p}.mlp.gate_proj.weight": (f, h),
                   f"{p}.mlp.up_proj.weight": (f, h), f"{p}.mlp.down_proj.weight": (h, f)})
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:      # Qwen3 norms are around 1; Qwen3.5's are zero-centred
            base = 0.0 if arch == "qwen3_5" else 1.0
            out[name] = (base + 0.05 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
        else:
            out[name] = (0.02 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
    return out


def write_tokenizer(out: str, tokenizer) -> None:
    tokenizer.inner.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as fh:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|endoftext|>",
                   "pad_token": "<|endoftext|>", "model_max_length": 512}, fh, indent=1)


# -- producers (each in its own venv) ------------------------------------------------------------------

# a run other than the fixtures' (--quality-out): the source models, the calibration texts, the output root
JOB: dict = {}


def calib_ids(n: int = 8, seqlen: int = 64, seed: int = 1234):
    """[n, seqlen] token ids of printable ASCII bytes (ids 35..129 of the byte-level vocabulary), fixed seed."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3 + 32, 3 + 127, (n, seqlen), generator=g)


def calib_samples(arch: str, n: int = 8, seqlen: int = 64) -> list:
    """Calibration token ids, one [1, L] tensor each: the job's texts tokenized by the source model's tokenizer
    (at most 256 tokens each), or the fixtures' seeded random bytes."""
    import torch
    if not JOB.get("calib_texts"):
        return [row[None] for row in calib_ids(n, seqlen)]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(base_dir(arch))
    return [torch.tensor([tok.encode(t)[:256]]) for t in JOB["calib_texts"]]


def base_dir(arch: str) -> str:
    """The bf16 base models: made for each fixture run (seeded, so the same every time) and not kept in the
    repository, or the job's source models."""
    return JOB.get("sources", {}).get(arch) or os.path.join(FIX, "_base", arch)


def out_root() -> str:
    return JOB.get("out") or FIX


def copy_tokenizer(out: str, arch: str) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(base_dir(arch), f), out)


def produce_modelopt(arch, out, cfg):
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base_dir(arch), dtype=torch.bfloat16)
    samples = calib_samples(arch, 4, 32)
    model = mtq.quantize(model, getattr(mtq, cfg), lambda m: [m(ids) for ids in samples])
    with torch.inference_mode():
        export_hf_checkpoint(model, export_dir=out)
    copy_tokenizer(out, arch)              # the export writes no tokenizer


def produce_llmc(arch, out, scheme=None, config_groups=None, ignore=("lm_head",), algo="rtn"):
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base_dir(arch), dtype=torch.bfloat16)
    samples = calib_samples(arch)
    ds = Dataset.from_dict({"input_ids": [s[0].tolist() for s in samples],
                            "attention_mask": [[1] * s.shape[1] for s in samples]})
    kw = {"scheme": scheme} if scheme else {"config_groups": config_groups}
    recipe = (GPTQModifier if algo == "gptq" else QuantizationModifier)(targets="Linear", ignore=list(ignore), **kw)
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=len(samples),
            max_seq_length=max(s.shape[1] for s in samples), shuffle_calibration_samples=False)
    model.save_pretrained(out, save_compressed=True)
    copy_tokenizer(out, arch)


def produce_gptqmodel(arch, out, _dtype="bfloat16", **qkw):
    import torch
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
    torch.manual_seed(0)
    qkw.setdefault("offload_to_disk", False)            # else a /tmp path lands in the config
    model = GPTQModel.load(base_dir(arch), QuantizeConfig(**qkw), device="cpu", dtype=getattr(torch, _dtype))
    calib = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)} for ids in calib_samples(arch)]
    # the default AWQ packer needs CUDA
    model.quantize(calib, batch_size=1, **({"backend": BACKEND.AWQ_TORCH} if qkw.get("quant_method") == "awq" else {}))
    model.save(out)
    for f in ("quant_log.csv",):                         # timings: not deterministic
        if os.path.exists(os.path.join(out, f)):
            os.remove(os.path.join(out, f))
    copy_tokenizer(out, arch)


def calib_texts(tok):
    return JOB.get("calib_texts") or [tok.decode(r) for r in calib_ids().tolist()]


def produce_hf_optimum(arch, out, **gkw):
    """transformers GPTQConfig -> optimum's GPTQQuantizer -> gptqmodel (quantized at load; writes gptq_v2)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPTQConfig
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(base_dir(arch))
    q = GPTQConfig(dataset=calib_texts(tok), tokenizer=tok, **gkw)
    m = AutoModelForCausalLM.from_pretrained(base_dir(arch), dtype=torch.float16, quantization_config=q, device_map="cpu")
    m.save_pretrained(out)
    copy_tokenizer(out, arch)


def produce_autoawq(arch, out, **quant_config):
    import torch
    from awq import AutoAWQForCausalLM
    from transformers import AutoTokenizer
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(base_dir(arch))
    m = AutoAWQForCausalLM.from_pretrained(base_dir(arch), device_map="cpu", dtype=torch.float16)
    texts = calib_texts(tok)
    m.quantize(tok, quant_config=quant_config, calib_data=texts, max_calib_samples=len(texts),
               max_calib_seq_len=256 if JOB.get("calib_texts") else 64)
    m.save_quantized(out)
    copy_tokenizer(out, arch)


PRODUCERS = {"modelopt": produce_modelopt, "llmc": produce_llmc, "gptqmodel": produce_gptqmodel,
             "hf_optimum": produce_hf_optimum, "autoawq": produce_autoawq}

# -- the producers' own dequantizers (same venvs) -------------------------------------------------------


def load_tensors(d: str) -> dict:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors") and f != "producer_probe.safetensors":
            out.update(load_file(os.path.join(d, f)))
    return out


def dequantize_modelopt(d: str, cfg: str) -> tuple[dict, str]:
    import torch
    from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor
    t, out = load_tensors(d), {}
    for name in t:
        if not name.endswith(".weight_scale"):
            continue
        m = name[:-len(".weight_scale")]
        w = t[m + ".weight"]
        if cfg.startswith("FP8"):
            out[m] = FP8QTensor(w.shape, torch.float32, w).dequantize(dtype=torch.float32, scale=t[m + ".weight_scale"])
        else:
            out[m] = NVFP4QTensor(torch.Size([w.shape[0], w.shape[1] * 2]), torch.float32, w).dequantize(
                dtype=torch.float32, scale=t[m + ".weight_scale"], double_scale=t[m + ".weight_scale_2"],
                block_sizes={-1: 16})
    return out, "modelopt.torch.quantization.qtensor FP8QTensor / NVFP4QTensor .dequantize"


def dequantize_ct(d: str) -> tuple[dict, str]:
    """compressed-tensors 0.19 through transformers 5.17's loader with dequantize=True (its decompressors)."""
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    t = load_tensors(d)
    modules = {n.rsplit(".", 1)[0] for n in t if n.endswith((".weight_packed", ".weight_scale"))}
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))
    sd = m.state_dict()
    return ({mod: sd[mod + ".weight"].float() for mod in modules},
            "compressed-tensors decompressors via transformers CompressedTensorsConfig(dequantize=True)")


def dequantize_ct_tensors(d: str) -> tuple[dict, str]:
    """compressed-tensors 0.19's compressor of the checkpoint's format, called on each module's tensors (the MoE
    fixtures: transformers fuses the experts when it loads them, so its dequantized state dict has no per-expert
    weights to probe)."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    qc = json.load(open(os.path.join(d, "config.json")))["quantization_config"]
    (group,) = qc["config_groups"].values()
    scheme = QuantizationScheme(targets=group["targets"], weights=QuantizationArgs(**group["weights"]),
                                input_activations=group.get("input_activations") and
                                QuantizationArgs(**group["input_activations"]))
    compressor = BaseCompressor.get_value_from_registry(qc["format"])
    t, out = load_tensors(d), {}
    for m in sorted({n.rsplit(".", 1)[0] for n in t if n.endswith(".weight_scale")}):
        # float32 scales: the compressor computes in the scale's dtype (bf16 on disk would round its result)
        tensors = {n[len(m) + 1:]: (v.float() if v.dtype == torch.bfloat16 else v)
                   for n, v in t.items() if n.rsplit(".", 1)[0] == m}
        out[m] = compressor.decompress(tensors, scheme)["weight"].float()
    return out, f"compressed-tensors {compressor.__name__}.decompress on each module's tensors, float32 scales"


def dequantize_gptq(d: str) -> tuple[dict, str]:
    import torch
    from gptqmodel.utils.model_dequant import dequantize_model
    tmp = tempfile.mkdtemp()
    shutil.rmtree(tmp)
    dequantize_model(d, tmp, target_dtype=torch.float32)
    ref = load_tensors(tmp)
    shutil.rmtree(tmp)
    modules = {n[:-len(".qweight")] for n in load_tensors(d) if n.endswith(".qweight")}
    return {m: ref[m + ".weight"].float() for m in modules}, "gptqmodel.utils.model_dequant.dequantize_model"


def dequantize_awq(d: str, legacy: bool) -> tuple[dict, str]:
    if legacy:
        from awq.utils.packing_utils import dequantize_gemm
        what = "awq.utils.packing_utils.dequantize_gemm (AutoAWQ)"
    else:   # not gptqmodel's model_dequant: it ignores AWQ's nibble order (gptqmodel 7.6)
        from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
        what = "gptqmodel.quantization.awq.utils.packing_utils.dequantize_gemm"
    qc = json.load(open(os.path.join(d, "config.json")))["quantization_config"]
    t, out = load_tensors(d), {}
    for n in t:
        if n.endswith(".qweight"):
            m = n[:-len(".qweight")]
            w = dequantize_gemm(t[m + ".qweight"], t[m + ".qzeros"], t[m + ".scales"].float(), qc["bits"], qc["group_size"])
            out[m] = w.float().t().contiguous()                    # [in, out] -> [out, in]
    return out, what


def write_probe(d: str, dense: dict) -> None:
    import torch
    from safetensors.torch import save_file
    probe = {}
    for m in sorted(dense):
        w = dense[m]
        g = torch.Generator().manual_seed(int(hashlib.sha256(m.encode()).hexdigest()[:8], 16))
        idx = torch.stack([torch.randint(0, w.shape[0], (PROBES,), generator=g),
                           torch.randint(0, w.shape[1], (PROBES,), generator=g)], 1)
        probe[m + ".idx"] = idx.to(torch.int32)
        probe[m + ".val"] = w[idx[:, 0], idx[:, 1]].float().contiguous()
    save_file(probe, os.path.join(d, "producer_probe.safetensors"))


def probe_fixture(name: str) -> str:
    venv, prod, _arch, opts = FIXTURES[name]
    d = os.path.join(FIX, name)
    if prod == "modelopt":
        dense, what = dequantize_modelopt(d, opts["cfg"])
    elif prod == "llmc":
        dense, what = dequantize_ct_tensors(d) if _arch in MOE_ARCHS else dequantize_ct(d)
    elif prod == "autoawq" or opts.get("quant_method") == "awq":
        dense, what = dequantize_awq(d, legacy=prod == "autoawq")
    else:
        dense, what = dequantize_gptq(d)
    write_probe(d, dense)
    return what


# -- driver / worker ----------------------------------------------------------------------------------

def worker(venv: str, names: list[str], job: str | None) -> None:
    from importlib.metadata import version
    if job:
        JOB.update(json.load(open(job)))
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")        # gptqmodel 7.6 fails on <= 2-core hosts without it
    work = tempfile.mkdtemp(prefix="fixtures-")
    os.chdir(work)                                             # producers drop logs into the cwd
    versions = {p: version(p) for p in VERSIONS[venv]}
    for name in names:
        _, prod, arch, opts = TABLE[name]
        out = os.path.join(out_root(), name)
        shutil.rmtree(out, ignore_errors=True)
        t = time.time()
        PRODUCERS[prod](arch, out, **opts)
        seconds = round(time.time() - t, 1)
        what = probe_fixture(name) if not JOB else ""
        print("DONE " + json.dumps({"name": name, "seconds": seconds, "dequantizer": what, "versions": versions}),
              flush=True)
    shutil.rmtree(work, ignore_errors=True)


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def write_manifest(done: dict, bases: dict) -> None:
    path = os.path.join(FIX, "MANIFEST.json")
    manifest = json.load(open(path)) if os.path.exists(path) else {"fixtures": {}}
    manifest["base_model_sha256"] = {**manifest.get("base_model_sha256", {}), **bases}
    manifest["generator"] = "tools/dev/make_quant_fixtures.py (venvs: tools/dev/quant_fixture_venvs.sh)"
    manifest["probe"] = (f"producer_probe.safetensors: the producer's own dequantized weight at {PROBES} seeded "
                         "positions of every quantized linear (<module>.idx int32 [n, 2], <module>.val float32 [n])")
    for name in sorted(FIXTURES):
        d = os.path.join(FIX, name)
        if not os.path.isdir(d):
            continue
        entry = manifest["fixtures"].get(name, {})
        if name in FIXTURES:
            venv, prod, arch, opts = FIXTURES[name]
            entry.update(producer=prod, arch=arch, options=opts)
        entry.update(done.get(name, {}))
        entry.pop("name", None)
        entry["files"] = {f: {"bytes": os.path.getsize(os.path.join(d, f)), "sha256": sha256(os.path.join(d, f))}
                          for f in sorted(os.listdir(d))}
        manifest["fixtures"][name] = entry
    with open(path, "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.write("\n")


def run_workers(pythons: dict, names: list[str], job: str | None = None) -> dict:
    done = {}
    for v, py in pythons.items():
        group = [n for n in names if TABLE[n][0] == v]
        if not group:
            continue
        r = subprocess.run([py, os.path.abspath(__file__), "--worker", v, *(["--job", job] if job else []), *group],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for line in r.stdout.splitlines():
            if line.startswith("DONE "):
                entry = json.loads(line[5:])
                done[entry["name"]] = entry
                print(f"{entry['name']}: {entry['seconds']} s", flush=True)
        if r.returncode:
            sys.exit(f"worker {v} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    return done


def quality_run(a) -> None:
    sys.path.insert(0, REPO)
    from tools.quality.calibration_texts import calibration_texts
    sources = dict(s.split("=", 1) for s in a.source)
    names = [n for n in QUALITY if a.only in n and QUALITY[n][2] in sources]
    os.makedirs(a.quality_out, exist_ok=True)
    job = os.path.join(a.quality_out, "job.json")
    with open(job, "w") as fh:
        json.dump({"sources": sources, "out": os.path.abspath(a.quality_out), "calib_texts": calibration_texts()}, fh)
    pythons = {v: os.path.join(a.venvs, v, "bin", "python") for v in VERSIONS}
    done = run_workers(pythons, names, job)
    with open(os.path.join(a.quality_out, "producers.json"), "w") as fh:
        json.dump({n: {**e, "producer": QUALITY[n][1], "options": QUALITY[n][3]} for n, e in done.items()}, fh, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venvs", default="",
                    help="directory holding the producer venvs main/ llmc/ gptq/ legacy/ (quant_fixture_venvs.sh)")
    ap.add_argument("--only", default="", help="substring of the fixture names to make")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--quality-out", default="", metavar="DIR",
                    help="instead of the fixtures: every layout from its producer on --source models, into DIR")
    ap.add_argument("--source", action="append", default=[], metavar="ARCH=DIR",
                    help="the bf16 model of an arch (qwen3, qwen3_5) for --quality-out")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("names", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker, a.names, a.job)
    if a.quality_out:
        return quality_run(a)
    names = [n for n in FIXTURES if a.only in n]
    if a.list:
        print("\n".join(f"{n:36s} {FIXTURES[n][1]:10s} {FIXTURES[n][3]}" for n in names))
        return
    pythons = {v: os.path.join(a.venvs, v, "bin", "python") for v in VERSIONS}
    missing = [p for v, p in pythons.items() if any(FIXTURES[n][0] == v for n in names) and not os.path.exists(p)]
    if missing:
        sys.exit(f"missing producer venvs {missing}: run tools/dev/quant_fixture_venvs.sh DIR, then pass --venvs DIR")
    sys.path.insert(0, REPO)
    bases = {}
    for arch in sorted({FIXTURES[n][2] for n in names}):
        shutil.rmtree(base_dir(arch), ignore_errors=True)
        build_base(arch, base_dir(arch))
        bases[arch] = sha256(os.path.join(base_dir(arch), "model.safetensors"))
    done = run_workers(pythons, names)
    shutil.rmtree(os.path.dirname(base_dir("qwen3")))
    write_manifest(done, bases)


if __name__ == "__main__":
    main()
