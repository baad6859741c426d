"""Quantized Qwen3.5-class hybrids: the shared hybrid quantized by `ninfer quantize` (FP8 blocks and
NVFP4: every linear layer but lm_head -- the fused q k v z and b a input projections of the Gated
DeltaNet layers, their out_proj, gated attention's q|gate k v and o, the MLPs, the MTP layer) loads,
and its logits equal those of the same checkpoint dequantized by the reference and loaded as float32,
at TP=1 and TP=2; greedy MTP equals k = 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import assert_kv_idle, make_llm
from engine import SamplingParams
from engine.quant.quantize import quantize_checkpoint
from tests.support.hybrid import require_shared_hybrid
from tests.engine.quant.test_loader import dequantize_dir, rel_diff

PROMPTS = ['{"id": 4, "name": "', [5, 9, 77, 300, 12, 8, 41, 7, 250, 3, 3, 3, 199]]


@pytest.fixture(scope="module", params=["fp8", "nvfp4"])
def hybrid_pair(request, tmp_path_factory):
    model = Path(require_shared_hybrid())
    root = tmp_path_factory.mktemp(f"hq-{request.param}")
    scheme = quantize_checkpoint(model, root / "q", request.param)
    return request.param, scheme, root / "q", dequantize_dir(root / "q", root / "ref")


def test_quantized_hybrid_logits_equal_the_dequantized_reference(hybrid_pair):
    fmt, scheme, q, ref = hybrid_pair
    quant, plain = make_llm(str(q)), make_llm(str(ref))
    assert quant.engine.model_config.quant.format == fmt
    layer = quant.engine.executor.driver.model.model.layers[0]
    assert layer.linear_attn.in_proj_ba is None              # b and a share the one input projection
    for linear in (layer.linear_attn.in_proj, layer.linear_attn.out_proj, layer.mlp.gate_up_proj):
        assert linear.quant == fmt
    full = quant.engine.executor.driver.model.model.layers[3]
    assert full.self_attn.qkv_proj.quant == fmt and full.self_attn.o_proj.quant == fmt
    assert any(m.endswith("linear_attn.in_proj_b") for m in scheme.modules)
    for prompt in PROMPTS:
        assert rel_diff(quant.prompt_logits(prompt), plain.prompt_logits(prompt)) < 1e-5


def test_quantized_hybrid_tp2_equals_the_reference(hybrid_pair):
    _, _, q, ref = hybrid_pair
    two, plain = make_llm(str(q), tensor_parallel_size=2), make_llm(str(ref))
    for prompt in PROMPTS:
        assert rel_diff(two.prompt_logits(prompt), plain.prompt_logits(prompt)) < 1e-5


def test_quantized_hybrid_mtp_is_lossless(hybrid_pair):
    _, _, q, _ = hybrid_pair
    greedy = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0)
    k0 = [o.token_ids for o in make_llm(str(q)).generate(PROMPTS, greedy)]
    llm = make_llm(str(q), draft_tokens=3)
    assert llm.engine.executor.driver.model.mtp.fc.quant is not None
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == k0
    assert_kv_idle(llm.engine)


def test_unquantized_b_a_beside_quantized_qkv_z_load_as_their_own_layer(tmp_path):
    # ModelOpt checkpoints may keep the small in_proj_b/a in bf16: then they are a layer of their own
    model = Path(require_shared_hybrid())
    scheme = quantize_checkpoint(model, tmp_path / "q", "nvfp4", exclude=("*.in_proj_b", "*.in_proj_a"))
    assert not any(m.endswith((".in_proj_b", ".in_proj_a")) for m in scheme.modules)
    ref = dequantize_dir(tmp_path / "q", tmp_path / "ref")
    llm, plain = make_llm(str(tmp_path / "q")), make_llm(str(ref))
    layer = llm.engine.executor.driver.model.model.layers[0].linear_attn
    assert layer.in_proj.quant == "nvfp4" and layer.in_proj_ba is not None and layer.in_proj_ba.quant is None
    for prompt in PROMPTS:
        assert rel_diff(llm.prompt_logits(prompt), plain.prompt_logits(prompt)) < 1e-5
