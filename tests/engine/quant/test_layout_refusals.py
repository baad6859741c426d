"""A layout the engine does not serve is refused before any weight is read, naming the config field or the
tensor; a tensor-parallel split that would cut a group is refused naming the tensor. Each case edits one
producer-made fixture (tests/fixtures/quant) in a temporary copy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import make_llm
from tests.support import quant_layouts as ql
from engine import ModelLoadError

L0 = "model.layers.0"


def edited(name: str, tmp: Path, config=None, tensors=None) -> Path:
    dst = tmp / name.replace("/", "-")
    shutil.copytree(ql.FIXTURES / name, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
        (dst / "hf_quant_config.json").unlink(missing_ok=True)
    if tensors:
        file = dst / "model.safetensors"
        t = load_file(str(file))
        tensors(t)
        save_file({n: x.contiguous() for n, x in t.items()}, str(file))
        index = dst / "model.safetensors.index.json"
        if index.exists():                      # the index names what the edited file now holds
            doc = json.loads(index.read_text())
            doc["weight_map"] = {**{n: f for n, f in doc["weight_map"].items() if f != file.name},
                                 **{n: file.name for n in t}}
            index.write_text(json.dumps(doc))
    return dst


def refused(path: Path, **kw) -> str:
    with pytest.raises(ModelLoadError) as e:
        make_llm(str(path), kv_capacity=1024, **kw)
    return str(e.value)


@pytest.mark.parametrize("name, edit, message", [
    ("gptq_int4_sym/qwen3", lambda c: c.update(bits=3), "quantization_config.bits=3 is not supported"),
    ("gptq_int4_sym/qwen3", lambda c: c.update(checkpoint_format="marlin"),
     "quantization_config.checkpoint_format='marlin' is not supported"),
    ("gptq_int4_sym/qwen3", lambda c: c.update(lm_head=True), "quantization_config.lm_head=True is not supported"),
    ("gptq_int4_sym/qwen3", lambda c: c.update(pack_dtype="int16"), "quantization_config.pack_dtype='int16'"),
    ("gptq_int4_sym/qwen3", lambda c: c.update(dynamic={r"+:.*down_proj": {"bits": 8}}),
     "quantization_config.dynamic sets per-module bits or groups"),
    ("gptq_int4_sym/qwen3", lambda c: c.update(group_size=0), "quantization_config.group_size=0 is not supported"),
    ("awq_gemm_g64/qwen3", lambda c: c.update(version="gemv"), "quantization_config.version='gemv' is not supported"),
    ("awq_gemm_g64/qwen3", lambda c: c.update(bits=8), "quantization_config.bits=8 is not supported"),
    ("ct_w4a16_sym/qwen3", lambda c: c.update(format="marlin-24") or c["config_groups"]["group_0"].pop("format"),
     "quantization_config.config_groups.group_0.format='marlin-24' is not supported"),
    ("ct_w4a16_sym/qwen3", lambda c: c["config_groups"]["group_0"].update(
        input_activations={"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True}),
     "quantization_config.config_groups.group_0.input_activations.type='int' is not supported"),
    ("ct_w4a16_sym/qwen3", lambda c: c["config_groups"]["group_0"]["weights"].update(strategy="tensor_group"),
     "quantization_config.config_groups.group_0.weights.strategy='tensor_group' is not supported"),
    ("ct_w4a16_sym/qwen3", lambda c: c.update(sparsity_config={"format": "sparse-24-bitmask"}),
     "quantization_config.sparsity_config is set"),
    ("ct_w4a16_sym/qwen3", lambda c: c.update(kv_cache_scheme={"num_bits": 8, "type": "float"}),
     "quantization_config.kv_cache_scheme="),
    ("ct_fp8_block/qwen3", lambda c: c["config_groups"]["group_0"]["weights"].update(block_structure=[64, 64]),
     "quantization_config.config_groups.group_0.weights.block_structure=[64, 64] is not supported"),
    ("ct_w4a16_sym/qwen3", lambda c: c["ignore"].append(f"{L0}.mlp.down_proj"),
     f"{L0}.mlp.down_proj.weight_scale: the module is in quantization_config.ignore but carries quantized tensors"),
    ("modelopt_fp8/qwen3", lambda c: c.update(quant_algo="W4A8_AWQ"),
     "quantization_config.quant_algo='W4A8_AWQ' is not supported; supported: FP8, NVFP4"),
    ("modelopt_fp8/qwen3", lambda c: c.update(kv_cache_quant_algo="FP8"), "quantization_config.kv_cache_quant_algo='FP8'"),
    ("modelopt_fp8/qwen3", lambda c: c["ignore"].append("*.o_proj"),
     f"{L0}.self_attn.o_proj.weight_scale: the module is in ignore but carries quantized tensors"),
])
def test_an_unserved_config_is_refused_naming_the_field(tmp_path, name, edit, message):
    assert message in refused(edited(name, tmp_path, config=edit))


@pytest.mark.parametrize("name, edit, message", [
    ("gptq_int4_sym/qwen3", lambda t: t.update({f"{L0}.mlp.up_proj.qzeros": t[f"{L0}.mlp.up_proj.qzeros"].half()}),
     f"{L0}.mlp.up_proj.qzeros is F16 (the gptq layout needs I32)"),
    ("awq_gemm_g64/qwen3", lambda t: t.update({f"{L0}.mlp.down_proj.scales": t[f"{L0}.mlp.down_proj.scales"][:2]}),
     f"{L0}.mlp.down_proj.scales [2, 128] (expected [4, 128])"),
    ("ct_w8a16_asym/qwen3", lambda t: t.pop(f"{L0}.self_attn.o_proj.weight_zero_point"),
     f"missing tensors (1): {L0}.self_attn.o_proj.weight_zero_point"),
    ("gptq_int4_sym/qwen3", lambda t: t.pop(f"{L0}.self_attn.k_proj.qweight"),
     f"{L0}.self_attn.q_proj (quantized), {L0}.self_attn.k_proj (not)"),
    # desc_act false, but the g_idx is a permutation
    ("gptq_int4_sym/qwen3", lambda t: t.update({f"{L0}.mlp.down_proj.g_idx": t[f"{L0}.mlp.down_proj.g_idx"].flip(0)}),
     f"{L0}.mlp.down_proj.g_idx: the groups are permuted but quantization_config.desc_act is false"),
    # act order: q, k and v share their input, so GPTQ gives them one g_idx
    ("gptq_int4_asym_descact_g32/qwen3",
     lambda t: t.update({f"{L0}.self_attn.v_proj.g_idx": t[f"{L0}.self_attn.v_proj.g_idx"].roll(1)}),
     f"{L0}.self_attn.v_proj.g_idx: differs from the other fused parts'"),
])
def test_a_bad_tensor_is_refused_by_name(tmp_path, name, edit, message):
    assert message in refused(edited(name, tmp_path, tensors=edit))


@pytest.mark.parametrize("name", ["gptq_int4_sym/qwen3", "ct_w4a16_sym/qwen3", "awq_gemm_autoawq/qwen3"])
def test_a_split_that_cuts_a_group_is_refused_naming_the_tensor(name):
    """Groups of 128 input columns; o_proj has 256: two ranks take a group each, four would cut them."""
    message = refused(ql.FIXTURES / name, tensor_parallel_size=4)
    assert f"{L0}.self_attn.o_proj.qweight: in_features 64 per rank (256 over 4 ranks) would cut its groups of 128" \
        in message


def test_groups_of_64_split_over_four_ranks():
    """The same split with groups of 64 (every rank holds whole groups): it loads, and equals one rank."""
    name = ql.FIXTURES / "ct_w4a16_asym_g64/qwen3"
    four, one = make_llm(str(name), kv_capacity=1024, tensor_parallel_size=4), make_llm(str(name), kv_capacity=1024)
    prompt = "def fibonacci(n):\n    if n < 2:"
    a, b = four.prompt_logits(prompt), one.prompt_logits(prompt)
    assert float((a - b).abs().max() / b.abs().max()) < 1e-5


def test_the_tensors_decide_what_is_quantized():
    """gptqmodel leaves the hybrid's in_proj_a/b in bf16 and records nothing: those load as plain layers,
    beside a quantized in_proj (qkv, z)."""
    llm = make_llm(str(ql.FIXTURES / "gptq_int4_sym/qwen3_5"), kv_capacity=1024)
    gdn = llm.engine.executor.driver.model.model.layers[0].linear_attn
    assert gdn.in_proj.quant == "int" and gdn.in_proj_ba is not None and gdn.in_proj_ba.quant is None
    assert torch.isfinite(llm.prompt_logits("hello")).all()
