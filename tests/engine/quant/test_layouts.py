"""Checkpoints as their producers write them (tests/fixtures/quant, made by tools/dev/make_quant_fixtures.py:
ModelOpt, llmcompressor's compressed-tensors, gptqmodel's GPTQ v1, transformers/optimum's GPTQ v2, AutoAWQ and
gptqmodel's AWQ GEMM), loaded by the engine:
  - the reference dequantizer (tests/support/quant_layouts.py, written from the format descriptions) equals
    each producer's OWN dequantizer at the positions the fixture recorded (producer_probe.safetensors);
  - the engine's logits equal those of the fixture dequantized by that reference and loaded as float32;
  - TP=2 equals TP=1 (packed weights, scales, zero points and g_idx split over two CPU ranks).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_llm
from tests.support import quant_layouts as ql

FIXTURES = ql.fixture_names()
PROMPTS = ["def fibonacci(n):\n    if n < 2:", [5, 9, 77, 300, 12, 8, 41, 7, 250, 3, 3, 3, 199, 42, 42, 17]]
# compressed-tensors decompresses NVFP4 in bf16 (fp4 * (scale / global scale) rounded to bf16): its values are
# the exact ones rounded to bf16 (tools/dev/make_quant_fixtures.py records the dequantizer of each fixture)
PRODUCER_ROUNDING = {"ct_nvfp4/qwen3": 2 ** -8}


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", FIXTURES)
def test_the_reference_equals_the_producers_own_dequantizer(name):
    d = ql.FIXTURES / name
    dense, probe = ql.reference_dense(d), ql.probe(d)
    assert set(dense) == set(probe) and dense
    tol = PRODUCER_ROUNDING.get(name, 1e-6)
    for module, (idx, want) in probe.items():
        got = dense[module][idx[:, 0], idx[:, 1]]
        assert torch.allclose(got, want, rtol=tol, atol=1e-12), (module, float((got - want).abs().max()))


@pytest.fixture(scope="module")
def dequantized(tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = ql.dequantized_dir(ql.FIXTURES / name, tmp_path_factory.mktemp(name.replace("/", "-")))
        return made[name]
    return get


@pytest.mark.parametrize("name", FIXTURES)
def test_engine_logits_equal_the_dequantized_reference(name, dequantized):
    quant = make_llm(str(ql.FIXTURES / name), kv_capacity=1024)
    plain = make_llm(str(dequantized(name)), kv_capacity=1024)
    modules = quant.engine.model_config.quant.modules
    assert modules == set(ql.reference_dense(ql.FIXTURES / name))   # quantized exactly where the producer did
    for prompt in PROMPTS:
        assert rel_diff(quant.prompt_logits(prompt), plain.prompt_logits(prompt)) < 1e-5


@pytest.mark.parametrize("name", FIXTURES)
def test_tp2_equals_tp1(name):
    one = make_llm(str(ql.FIXTURES / name), kv_capacity=1024)
    two = make_llm(str(ql.FIXTURES / name), kv_capacity=1024, tensor_parallel_size=2)
    assert two.engine.executor.num_ranks == 2
    for prompt in PROMPTS:
        assert rel_diff(two.prompt_logits(prompt), one.prompt_logits(prompt)) < 1e-5


@pytest.mark.parametrize("name, head", [("gptq_int4_asym_descact_g32/qwen3", "ct_w4a16_sym/qwen3"),
                                        ("ct_fp8_dynamic/qwen3_5", "ct_fp8_dynamic/qwen3_5"),
                                        ("awq_gemm/qwen3_5", "awq_gemm/qwen3_5")])
def test_graphed_rounds_equal_eager_with_mtp(name, head):
    """TP=2 in lockstep (the decode rounds CUDA graphs capture, run by a CPU stand-in) with k=3 equals TP=1
    eager with k=0: act order across ranks, per-channel FP8 and AWQ on the hybrid, an MTP head beside them."""
    from engine import SamplingParams
    from tests.support.graph_standin import StandInRounds
    prompts = ["def f(x):\n    return x * 2\n" * 2, "Line 1: the quick brown fox", "a b c d e f g h"]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    want = [o.token_ids for o in make_llm(str(ql.FIXTURES / name), kv_capacity=1024).generate(prompts, greedy)]
    two = make_llm(str(ql.FIXTURES / name), kv_capacity=1024, tensor_parallel_size=2, draft_tokens=3, max_batch=4,
                   speculative_model=str(ql.FIXTURES / head))
    ex = two.engine.executor
    for runner in ex.runners:
        runner.graphs = StandInRounds(ex, runner, [1, 2, 4])
    assert [o.token_ids for o in two.generate(prompts, greedy)] == want
    assert ex.runners[0].graphs.launches > 0


@pytest.mark.parametrize("tp", [1, 2])
def test_act_order_on_the_hybrid(tmp_path, dequantized, tp):
    """gptqmodel's Qwen3.5 checkpoint read as desc_act: every fused input projection of a layer (in_proj_qkv and
    in_proj_z of the Gated DeltaNet, q/k/v, gate/up) takes one permuted g_idx, as GPTQ's act order gives the
    projections of one input; the engine's logits equal the reference dequantized with those groups."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    src = ql.FIXTURES / "gptq_int4_sym/qwen3_5"
    dst = tmp_path / "descact"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["desc_act"] = True
    (dst / "config.json").write_text(json.dumps(cfg))
    t = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    perms = {}
    for name in sorted(n for n in t if n.endswith(".g_idx")):
        module = name[:-len(".g_idx")]
        shared_input = module.rsplit(".", 1)[0] + ("/mlp_in" if module.endswith(("gate_proj", "up_proj")) else "/in")
        if module.endswith(("down_proj", "o_proj", "out_proj")):
            shared_input = module
        if shared_input not in perms:
            n = t[name].numel()
            perms[shared_input] = (torch.randperm(n, generator=gen) // 128).int()
        t[name] = perms[shared_input].clone()
    save_file(t, str(dst / "model.safetensors"))
    ref = ql.dequantized_dir(dst, tmp_path / "ref")
    quant = make_llm(str(dst), kv_capacity=1024, tensor_parallel_size=tp)
    plain = make_llm(str(ref), kv_capacity=1024)
    assert quant.engine.executor.driver.model.model.layers[0].linear_attn.in_proj.g_idx is not None
    for prompt in PROMPTS:
        assert rel_diff(quant.prompt_logits(prompt), plain.prompt_logits(prompt)) < 1e-5
