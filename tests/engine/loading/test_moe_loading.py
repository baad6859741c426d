"""Loading mixture-of-experts checkpoints: every config spelling producers write, every expert layout, and
clear errors.

- Per-expert tensors (transformers' save_pretrained, Qwen3-MoE, Qwen3-Next), fused stacks (transformers'
  in-memory state dict) and Qwen3.5-MoE's published layout (nested config, `model.language_model.`, fused
  main experts, per-expert MTP experts) load to bit-identical parameters.
- `num_experts` / `num_local_experts`, top-level `rope_theta` / `rope_parameters`, `full_attention_interval`
  / `layer_types`, flat / nested (`text_config`) configs read to the same ModelConfig.
- Qwen3-Next's grouped in_proj_qkvz / in_proj_ba rows land where Qwen3.5's flat projections have them.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.models.qwen3_next import split_projections
from tests.conftest import make_llm
from tests.support.moe import build_reference, write_checkpoint


def _params(llm) -> dict[str, torch.Tensor]:
    return dict(llm.engine.executor.driver.model.named_parameters())


@pytest.mark.parametrize("arch, layouts", [("qwen3_moe", ("transformers", "fused")),
                                           ("qwen3_5_moe", ("transformers", "fused", "published"))])
def test_expert_layouts_load_to_the_same_model(tmp_path, arch, layouts):
    model, mtp = build_reference(arch, seed=2)
    llms = [make_llm(str(write_checkpoint(model, mtp, tmp_path / layout, layout)), kv_capacity=256,
                     draft_tokens=3 if mtp else 0) for layout in layouts]
    names = json.loads((tmp_path / layouts[-1] / "config.json").read_text())
    first = _params(llms[0])
    assert any(".experts.w13_weight" in n for n in first) and any(n.startswith("mtp.") for n in first) == bool(mtp)
    for llm in llms[1:]:
        other = _params(llm)
        assert first.keys() == other.keys()
        for name, p in first.items():
            assert torch.equal(p, other[name]), name
    if "published" in layouts:
        assert names["model_type"] == "qwen3_5_moe" and "text_config" in names


def test_published_qwen3_5_layout_holds_fused_main_and_per_expert_mtp_experts(tmp_path):
    from safetensors import safe_open
    model, mtp = build_reference("qwen3_5_moe", seed=2)
    path = write_checkpoint(model, mtp, tmp_path / "pub", "published")
    with safe_open(path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in names
    assert "mtp.layers.0.mlp.experts.7.down_proj.weight" in names
    assert not any(n.startswith("model.layers.") for n in names)


QWEN3_NEXT_PUBLISHED = dict(     # as Qwen3-Next-80B-A3B's config.json writes it, shrunk
    model_type="qwen3_next", vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=5e6, partial_rotary_factor=0.25,
    full_attention_interval=4, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    eos_token_id=0, tie_word_embeddings=False)


def test_qwen3_next_spellings_read_alike():
    published = ModelConfig.from_hf(QWEN3_NEXT_PUBLISHED)
    saved = {k: v for k, v in QWEN3_NEXT_PUBLISHED.items()
             if k not in ("rope_theta", "partial_rotary_factor", "full_attention_interval", "num_experts")}
    saved.update(num_local_experts=8, layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
                 + ["full_attention"], rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                        "partial_rotary_factor": 0.25})
    assert ModelConfig.from_hf(saved) == published
    assert published.layer_types[3] == published.layer_types[7] == "full_attention"
    assert (published.partial_rotary_factor, published.rope_theta, published.mtp_num_hidden_layers) == (0.25, 5e6, 1)
    no_factor = {k: v for k, v in QWEN3_NEXT_PUBLISHED.items() if k != "partial_rotary_factor"}
    assert ModelConfig.from_hf(no_factor).partial_rotary_factor == 0.25          # transformers' default


def test_qwen3_5_moe_nested_and_flat_read_alike():
    model, _ = build_reference("qwen3_5_moe", seed=0)
    flat = json.loads(model.config.to_json_string())
    nested = {"model_type": "qwen3_5_moe", "text_config": {k: v for k, v in flat.items() if k != "eos_token_id"},
              "eos_token_id": flat["eos_token_id"], "tie_word_embeddings": False}
    a, b = ModelConfig.from_hf(flat), ModelConfig.from_hf(nested)
    assert dataclasses.replace(a, model_type="x") == dataclasses.replace(b, model_type="x")
    assert a.model_type == "qwen3_5_moe_text" and b.model_type == "qwen3_5_moe"
    assert a.norm_topk_prob and a.intermediate_size == 0 and a.shared_expert_intermediate_size == 48
    assert a.mtp_num_hidden_layers == 1


def test_qwen3_moe_defaults_and_spellings():
    base = dict(model_type="qwen3_moe", vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts_per_tok=2,
                moe_intermediate_size=32)
    a = ModelConfig.from_hf({**base, "num_experts": 8, "rope_theta": 1e6, "decoder_sparse_step": 2})
    b = ModelConfig.from_hf({**base, "num_local_experts": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                             "decoder_sparse_step": 2})
    assert a == b and not a.norm_topk_prob and not a.is_hybrid           # transformers' default: no renormalisation
    assert [a.layer_is_moe(i) for i in range(4)] == [False, True, False, True]
    assert a.num_params(include_mtp=False, active=True) < a.num_params(include_mtp=False)


@pytest.mark.parametrize("change, message", [
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9 exceeds num_experts=8"),
    ({"num_experts": 0}, r"num_experts=0: a mixture of experts \(qwen3_next\) needs an integer >= 1"),
    ({"shared_expert_intermediate_size": None}, r"shared_expert_intermediate_size=None"),
    ({"mlp_only_layers": [8]}, r"mlp_only_layers=\[8\]: needs layer indices in \[0, 8\)"),
    ({"decoder_sparse_step": 0}, r"decoder_sparse_step=0"),
    ({"mlp_only_layers": [1], "intermediate_size": 0}, r"layers \[1\] have dense MLPs .* intermediate_size is 0"),
])
def test_bad_moe_fields_are_named(change, message):
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf({**QWEN3_NEXT_PUBLISHED, **change})


def test_a_missing_expert_is_named(tmp_path):
    from safetensors.torch import load_file, save_file
    model, _ = build_reference("qwen3_moe", seed=0)
    path = write_checkpoint(model, {}, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensors \(1\): model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        make_llm(str(path), kv_capacity=256)


def test_qwen3_next_grouped_projections_split_into_qwen3_5_order():
    cfg = ModelConfig.from_hf(QWEN3_NEXT_PUBLISHED)               # 2 key heads of 16, 4 value heads of 16: r = 2
    hk, dk, dv, r = 2, 16, 16, 2
    per_group = 2 * dk + 2 * r * dv
    qkvz = torch.arange(hk * per_group, dtype=torch.float32)[:, None].repeat(1, 3)       # row i holds i
    ba = torch.arange(hk * 2 * r, dtype=torch.float32)[:, None].repeat(1, 3)
    out = split_projections(cfg, qkvz, ba)
    rows = {k: v[:, 0].long().tolist() for k, v in out.items()}
    group = lambda g, lo, n: list(range(g * per_group + lo, g * per_group + lo + n))  # noqa: E731
    assert rows["qkv"] == (group(0, 0, dk) + group(1, 0, dk) + group(0, dk, dk) + group(1, dk, dk)
                           + group(0, 2 * dk, r * dv) + group(1, 2 * dk, r * dv))
    assert rows["z"] == group(0, 2 * dk + r * dv, r * dv) + group(1, 2 * dk + r * dv, r * dv)
    assert rows["b"] == [0, 1, 4, 5] and rows["a"] == [2, 3, 6, 7]


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3.5-35b-a3b"])
def test_memory_plan_counts_every_expert_on_each_rank(name):
    """The plan's weights are every expert's bytes (the shard on the meta device), halved per rank at TP=2
    (each expert split on its intermediate dimension); the MTP layer's experts count where drafting."""
    from engine.config import EngineConfig
    from engine.loading.presets import preset
    from engine.worker.memory_plan import GiB, plan_memory
    cfg = preset(name)
    k = 1 if cfg.mtp_num_hidden_layers else 0
    plans = {tp: plan_memory(EngineConfig(model=f"preset:{name}", device="cuda", dtype="bfloat16", kv_capacity=4096,
                                          tensor_parallel_size=tp), cfg, k, 4096, available=140 * GiB) for tp in (1, 2)}
    params = cfg.num_params(include_mtp=k > 0)
    assert params * 2 <= plans[1].weights_bytes < params * 2 * 1.01          # + the RoPE table
    assert plans[2].weights_bytes == pytest.approx(plans[1].weights_bytes / 2, rel=0.01)


@pytest.mark.parametrize("fmt, bytes_per_param", [("fp8", 1 + 4 / (128 * 128)), ("nvfp4", 0.5 + 1 / 16)])
def test_memory_plan_counts_quantized_experts_in_their_dtypes(fmt, bytes_per_param):
    """`preset:qwen3-30b-a3b-fp8` / `-nvfp4`: every expert and attention projection in its format (FP8: a byte and a
    float32 scale per 128 x 128 block; NVFP4: half a byte and an E4M3 scale per 16), the embeddings, lm_head,
    routers and norms in bf16 -- the plan's weights are that sum (within 1 %: NVFP4's per-row float32 scales,
    88 MB, and the RoPE table)."""
    from engine.config import EngineConfig
    from engine.loading.presets import preset
    from engine.worker.memory_plan import GiB, plan_memory
    base, quantized = preset("qwen3-30b-a3b"), preset(f"qwen3-30b-a3b-{fmt}")
    h, heads, kv, d = base.hidden_size, base.num_attention_heads, base.num_key_value_heads, base.head_dim
    per_layer = 3 * base.num_experts * h * base.moe_intermediate_size + 2 * h * heads * d + 2 * h * kv * d
    linear = base.num_hidden_layers * per_layer
    want = linear * bytes_per_param + (base.num_params() - linear) * 2
    plan = plan_memory(EngineConfig(model=f"preset:qwen3-30b-a3b-{fmt}", device="cuda", dtype="bfloat16",
                                    kv_capacity=4096), quantized, 0, 4096, available=140 * GiB)
    assert plan.weights_bytes == pytest.approx(want, rel=0.01)
