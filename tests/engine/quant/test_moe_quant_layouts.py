"""Quantized mixture-of-experts checkpoints in the forms other producers write (docs/moe.md, "Checkpoint layouts"):

- the real producers' fixtures (tests/fixtures/quant/*/qwen3_moe, */qwen3_next: ModelOpt NVFP4, llmcompressor W4A16
  and FP8_DYNAMIC) load with their experts where they belong -- NVFP4 experts in the stacked NVFP4 parameters, integer
  and per-channel FP8 experts dequantized at load into model-dtype stacks -- and Qwen3-Next's quantized grouped DeltaNet
  projections kept quantized, their converted rows permuted into Qwen3.5's flat projections (their logits against
  the reference, and TP = 2: test_layouts.py);
- Qwen3-Next in Qwen's FP8 block layout with in_proj_qkvz / in_proj_ba quantized too (128x128 blocks that the
  grouped rows cut): dequantized at load; logits equal the dequantized reference and greedy MTP k = 3 equals k = 0;
- a quantized fused expert stack (`experts.gate_up_proj` [E, 2I, H] stored in FP8 with a scale beside it) is refused
  naming its tensors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import SamplingParams
from engine.errors import ModelLoadError
from engine.layers.moe import SparseMoeBlock
from engine.quant import formats
from engine.quant.quantize import quantize_checkpoint
from tests.conftest import assert_kv_idle, make_llm
from tests.engine.models.test_qwen3_vs_transformers import random_prompts
from tests.engine.quant.test_loader import dequantize_dir, rel_diff
from tests.support import quant_layouts as ql
from tests.support.moe import build_random_moe

pytest.importorskip("transformers")

PROMPTS = random_prompts(384, [11, 33], seed=2)


def sparse_blocks(llm) -> list[SparseMoeBlock]:
    return [l.mlp for l in llm.engine.executor.driver.model.model.layers if isinstance(l.mlp, SparseMoeBlock)]  # noqa: E741


# (fixture, the experts' kind in memory, the DeltaNet input projections' kinds: (qkv + z [+ b + a], separate b + a))
@pytest.mark.parametrize("name, experts, in_proj", [
    ("modelopt_nvfp4/qwen3_moe", "nvfp4", None), ("ct_w4a16_g16/qwen3_moe", None, None),
    # ModelOpt quantizes in_proj_qkvz and keeps in_proj_ba: two input projections
    ("modelopt_nvfp4/qwen3_next", "nvfp4", ("nvfp4", None)),
    # llmcompressor quantizes both per channel: one input projection of four parts
    ("ct_fp8_dynamic/qwen3_next", None, ("fp8_channel", "none")),
    # and as integers in groups of 16: integer experts dequantized, the grouped projections kept as integers
    ("ct_w4a16_g16/qwen3_next", None, ("int", "none"))])
def test_producer_fixtures_load_where_they_belong(name, experts, in_proj):
    llm = make_llm(str(ql.FIXTURES / name), kv_capacity=1024)
    quantized = llm.engine.model_config.quant.modules
    assert "model.layers.2.mlp.experts.7.down_proj" in quantized            # the producer quantized every expert
    blocks = sparse_blocks(llm)
    assert blocks and all(b.experts.quant == experts for b in blocks)
    if in_proj is not None:
        assert "model.layers.0.linear_attn.in_proj_qkvz" in quantized
        for la in llm.engine.executor.driver.model.linear_layers():
            assert (la.in_proj.quant, "none" if la.in_proj_ba is None else la.in_proj_ba.quant) == in_proj


@pytest.fixture(scope="module")
def next_fp8_grouped(tmp_path_factory):
    """Tiny Qwen3-Next quantized by `ninfer quantize --format fp8`, then its grouped DeltaNet input projections
    quantized in the same 128x128 blocks (as Qwen's FP8 releases store every linear layer)."""
    root = tmp_path_factory.mktemp("next-fp8-grouped")
    build_random_moe(root / "bf", "qwen3_next", seed=6, echo_mtp=1.2, shared_expert_intermediate_size=64)
    quantize_checkpoint(root / "bf", root / "q", "fp8", keep_mtp=False)
    path = root / "q" / "model.safetensors"
    t = load_file(str(path))
    grouped = [n for n in t if n.endswith((".in_proj_qkvz.weight", ".in_proj_ba.weight"))]
    assert grouped
    for name in grouped:
        w, scale = formats.quantize_fp8_block(t[name].float())
        t[name], t[name[:-len("weight")] + "weight_scale_inv"] = w, scale
    save_file(t, str(path), metadata={"format": "pt"})
    cfg = json.loads((root / "q" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"
    return root / "q", dequantize_dir(root / "q", root / "ref")


def test_qwen3_next_fp8_grouped_projections_match_the_reference(next_fp8_grouped):
    q, ref = next_fp8_grouped
    llm, plain = make_llm(str(q)), make_llm(str(ref))
    assert "model.layers.0.linear_attn.in_proj_ba" in llm.engine.model_config.quant.modules
    assert all(b.experts.quant == "fp8" for b in sparse_blocks(llm))
    # FP8 blocks do not survive the rows' permutation: dequantized at load, one unquantized input projection
    assert all(la.in_proj.quant is None and la.in_proj_ba is None
               for la in llm.engine.executor.driver.model.linear_layers())
    for ids in PROMPTS:
        assert rel_diff(llm.prompt_logits(ids), plain.prompt_logits(ids)) < 1e-5
    greedy = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
    k0 = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
    k3 = make_llm(str(q), draft_tokens=3)
    assert [o.token_ids for o in k3.generate(PROMPTS, greedy)] == k0
    assert_kv_idle(k3.engine)


def test_a_quantized_fused_expert_stack_is_refused_naming_it(tmp_path):
    path = tmp_path / "fused"
    build_random_moe(path, "qwen3_5_moe", layout="fused", with_mtp=False)
    t = load_file(str(path / "model.safetensors"))
    stack = "model.layers.1.mlp.experts.gate_up_proj"
    scale = formats.quantize_fp8_block(t[stack][0].float())[1]
    t[stack] = torch.stack([formats.quantize_fp8_block(x.float())[0] for x in t[stack]])
    t[stack + "_scale_inv"] = scale.expand(t[stack].shape[0], *scale.shape).contiguous()
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as e:
        make_llm(str(path))
    assert f"{stack} (F8_E4M3)" in str(e.value) and f"{stack}_scale_inv (F32)" in str(e.value)
    assert "quantized fused expert stacks are not read" in str(e.value)
