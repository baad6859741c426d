"""Quantized experts: tiny MoE checkpoints quantized by `ninfer quantize` (FP8 128x128 blocks and NVFP4 --
every expert's gate/up/down, the shared expert, attention, the DeltaNet projections and the MTP layer;
routers and shared-expert gates kept, as the producers keep them, and Qwen3-Next's grouped DeltaNet input
projections kept, which the loader permutes) load into the stacked quantized expert parameters, and their
logits equal those of the same checkpoint dequantized by the reference (engine.quant.formats) and loaded in
float32, at TP=1 and at TP=2 (each rank holding half of every expert's rows or columns, scale blocks
included); greedy MTP with k = 3 equals k = 0."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.layers.moe import SparseMoeBlock
from engine.quant import formats
from engine.quant.quantize import quantize_checkpoint
from tests.conftest import assert_kv_idle, make_llm
from tests.engine.models.test_qwen3_vs_transformers import random_prompts
from tests.engine.quant.test_loader import dequantize_dir, rel_diff
from tests.support.moe import build_random_moe

PROMPTS = random_prompts(384, [9, 37], seed=8)


@pytest.fixture(scope="module", params=[("qwen3_moe", "fp8"), ("qwen3_moe", "nvfp4"), ("qwen3_next", "fp8"), ("qwen3_next", "nvfp4"),
                                         ("qwen3_5_moe", "fp8"), ("qwen3_5_moe", "nvfp4")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def quantized(request, tmp_path_factory):
    arch, fmt = request.param
    root = tmp_path_factory.mktemp(f"mq-{arch}-{fmt}")
    # a shared expert of 64: NVFP4 groups of 16 must tile each rank's 32 columns at TP=2
    shared = {} if arch == "qwen3_moe" else {"shared_expert_intermediate_size": 64}
    build_random_moe(root / "bf", arch, seed=5, echo_mtp=1.2, **shared)
    scheme = quantize_checkpoint(root / "bf", root / "q", fmt)
    return arch, fmt, scheme, str(root / "q"), str(dequantize_dir(root / "q", root / "ref"))


def test_experts_load_quantized_and_match_the_dequantized_reference(quantized):
    arch, fmt, scheme, q, ref = quantized
    first_sparse = 1 if arch == "qwen3_next" else 0                         # its layer 0 is dense (tests/support/moe.py)
    assert f"model.layers.{first_sparse}.mlp.experts.3.down_proj" in scheme.modules
    assert not any(m.endswith((".mlp.gate", ".shared_expert_gate", ".in_proj_qkvz", ".in_proj_ba")) for m in scheme.modules)
    if arch == "qwen3_next":     # its grouped DeltaNet projections stay unquantized (the loader permutes their rows)
        assert "model.layers.0.linear_attn.out_proj" in scheme.modules
    llm, plain = make_llm(q), make_llm(ref)
    block = next(l.mlp for l in llm.engine.executor.driver.model.model.layers if isinstance(l.mlp, SparseMoeBlock))  # noqa: E741
    assert block.experts.quant == fmt and block.gate.quant is None
    assert block.experts.w13_weight.dtype == (torch.float8_e4m3fn if fmt == "fp8" else torch.uint8)
    if block.shared_expert is not None:
        assert block.shared_expert.gate_up_proj.quant == fmt and block.shared_expert_gate.quant is None
    for ids in PROMPTS:
        assert rel_diff(llm.prompt_logits(ids), plain.prompt_logits(ids)) < 1e-5


def test_tp2_quantized_experts_equal_the_reference(quantized):
    _, _, _, q, ref = quantized
    two, plain = make_llm(q, tensor_parallel_size=2), make_llm(ref)
    for ids in PROMPTS:
        # the ranks' partial sums add in another order than one rank's: float32 rounding, amplified by these
        # random weights to ~1e-5 of the largest logit (TP=1 equals the reference exactly)
        assert rel_diff(two.prompt_logits(ids), plain.prompt_logits(ids)) < 5e-5


def test_quantized_mtp_is_lossless(quantized):
    arch, _, _, q, _ = quantized
    if arch == "qwen3_moe":
        pytest.skip("Qwen3-MoE checkpoints have no MTP layer")
    greedy = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0)
    k0 = [o.token_ids for o in make_llm(q).generate(PROMPTS, greedy)]
    llm = make_llm(q, draft_tokens=3)
    assert llm.engine.executor.driver.model.mtp.layers[0].mlp.experts.quant is not None
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == k0
    assert_kv_idle(llm.engine)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("intermediate", [256, 192])
def test_expert_shards_hold_the_exact_dequantized_slices(fmt, intermediate):
    """Shapes where scale blocks matter (the tiny models have one block per projection): I = 256 splits at a
    block edge, I = 192 inside one (each rank's 96 rows take 32-row granules of the 128-row scale blocks).
    Each rank's expert, dequantized, is exactly its slice of the dequantized checkpoint expert, whether loaded
    from per-expert tensors or (unquantized) from a fused stack."""
    from engine.distributed.tp_group import TPGroup
    from engine.layers.moe_experts import FusedExperts
    from engine.quant.random_weights import quantize_tensor
    from engine.quant.scheme import QuantScheme
    E, H, I = 3, 384, intermediate
    gen = torch.Generator().manual_seed(0)
    scheme = QuantScheme(fmt)
    full = {}
    ckpt = {}
    for e in range(E):
        for part, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            w = torch.randn(shape, generator=gen)
            t = quantize_tensor(f"x.{e}.{part}.weight", w, scheme)
            ckpt.update(t)
            m = f"x.{e}.{part}"
            full[(e, part)] = (formats.dequantize_fp8_block(t[f"{m}.weight"], t[f"{m}.weight_scale_inv"]) if fmt == "fp8"
                               else formats.dequantize_nvfp4(t[f"{m}.weight"], t[f"{m}.weight_scale"], t[f"{m}.weight_scale_2"]))
    for rank in range(2):
        layer = FusedExperts(E, H, I, TPGroup(rank=rank, size=2), fmt)
        params = dict(layer.named_parameters())
        for name, t in ckpt.items():
            _, e, part, field = name.split(".", 3)
            params[("w2_" if part == "down_proj" else "w13_") + field].weight_loader(
                params[("w2_" if part == "down_proj" else "w13_") + field], t, (int(e), part))
        i = I // 2
        for e in range(E):
            w13, w2 = layer.expert_weights(e)
            assert torch.equal(w13[:i], full[(e, "gate_proj")][rank * i:(rank + 1) * i])
            assert torch.equal(w13[i:], full[(e, "up_proj")][rank * i:(rank + 1) * i])
            assert torch.equal(w2, full[(e, "down_proj")][:, rank * i:(rank + 1) * i])
