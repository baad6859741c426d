"""Loading Qwen3.5-class hybrid checkpoints: the CausalLM layout (the shared model), the
ConditionalGeneration layout (language model under model.language_model.*, vision tower skipped with
a log line), Qwen3-Next refused, and names, shapes and dtypes checked from the headers before any
weight is read."""

from __future__ import annotations

import json
import shutil

import pytest
import structlog
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import make_llm
from engine import ModelLoadError
from engine.config import ModelConfig
from engine.loading.checkpoint import CheckpointWeights, read_model_dir
from tests.support.hybrid import build_random_hybrid, build_random_multimodal, require_shared_hybrid

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def random_hybrid(tmp_path_factory):
    path = tmp_path_factory.mktemp("random-hybrid")
    return path, build_random_hybrid(path)


def test_shared_model_config_is_read_as_written():
    md = read_model_dir(require_shared_hybrid())
    cfg = md.config
    assert cfg.model_type == "qwen3_5_text" and cfg.is_hybrid
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + (
        "full_attention",)
    assert cfg.full_attention_layers == [3, 7] and cfg.linear_attention_layers == [0, 1, 2, 4, 5, 6]
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim) == (4, 8, 48, 48, 4)
    assert cfg.partial_rotary_factor == 0.25 and cfg.rope_theta == 1e7 and cfg.attn_output_gate
    assert cfg.mtp_num_hidden_layers == 1 and not cfg.tie_word_embeddings
    assert sum(n.startswith("mtp.") for n in md.weights.shapes()) == 15


def test_multimodal_layout_serves_its_language_model(tmp_path):
    hf = build_random_multimodal(tmp_path / "mm")
    cfg = json.loads((tmp_path / "mm/config.json").read_text())
    assert cfg["model_type"] == "qwen3_5" and "vision_config" in cfg
    with structlog.testing.capture_logs() as logs:
        llm = make_llm(str(tmp_path / "mm"), kv_capacity=1024)
    skipped = [e for e in logs if e["event"] == "vision_tower_skipped"]
    assert len(skipped) == 1 and skipped[0]["tensors"] > 0
    assert llm.engine.model_config.model_type == "qwen3_5" and llm.engine.model_config.is_hybrid
    ids = torch.randint(1, 384, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = llm.prompt_logits(ids)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    assert float((ours - ref).abs().max()) < 1e-4


def test_an_unknown_model_type_is_refused_naming_the_supported_ones():
    with pytest.raises(ModelLoadError, match=r"unsupported model_type 'qwen2_moe'; supported: qwen3, qwen3_moe, "
                                             r"qwen3_5_text, qwen3_5, qwen3_next, qwen3_5_moe_text, qwen3_5_moe"):
        ModelConfig.from_hf({"model_type": "qwen2_moe", "vocab_size": 8, "hidden_size": 8})


def test_bad_layer_types_are_named():
    base = json.loads((require_shared_hybrid_path() / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"layer_types has 3 entries for num_hidden_layers=8"):
        ModelConfig.from_hf(base | {"layer_types": ["linear_attention"] * 3})
    with pytest.raises(ModelLoadError, match=r"unsupported layer type\(s\) sliding_attention"):
        ModelConfig.from_hf(base | {"layer_types": ["sliding_attention"] * 8})


def require_shared_hybrid_path():
    from pathlib import Path
    return Path(require_shared_hybrid())


def _copy_with(tmp_path, src, tensors):
    dst = tmp_path / "broken"
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def test_wrong_shape_and_missing_linear_tensors_are_named_before_reading(tmp_path, random_hybrid, monkeypatch):
    src, _ = random_hybrid
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.1.linear_attn.conv1d.weight"] = torch.zeros(100, 1, 4)
    del tensors["model.layers.2.linear_attn.A_log"]
    dst = _copy_with(tmp_path, src, tensors)
    reads = []
    real_iter = CheckpointWeights.__iter__
    monkeypatch.setattr(CheckpointWeights, "__iter__", lambda self: reads.append(1) or real_iter(self))
    with pytest.raises(ModelLoadError) as e:
        make_llm(str(dst), kv_capacity=1024)
    msg = str(e.value)
    assert "missing tensors (1): model.layers.2.linear_attn.A_log" in msg
    assert "model.layers.1.linear_attn.conv1d.weight [100, 1, 4] (expected [160, 1, 4])" in msg
    assert reads == []


def test_non_float_dtype_is_named(tmp_path, random_hybrid):
    src, _ = random_hybrid
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.3.self_attn.k_proj.weight"] = tensors["model.layers.3.self_attn.k_proj.weight"].to(torch.int8)
    with pytest.raises(ModelLoadError, match=r"unsupported dtype \(1; supported: F32, BF16, F16\): "
                                             r"model\.layers\.3\.self_attn\.k_proj\.weight I8"):
        make_llm(str(_copy_with(tmp_path, src, tensors)), kv_capacity=1024)


def test_parameter_count_matches_the_modules():
    from engine.models.registry import model_class
    from engine.loading.presets import preset
    for cfg in (read_model_dir(require_shared_hybrid()).config, preset("qwen3.5-27b")):
        for with_mtp in (False, True):
            with torch.device("meta"):
                model = model_class(cfg)(cfg, with_mtp=with_mtp)
            assert cfg.num_params(include_mtp=with_mtp) == sum(p.numel() for p in model.parameters())
    assert read_model_dir(require_shared_hybrid()).config.num_params() == 22_428_672     # the card's 22.4 M
    assert preset("qwen3.5-27b").num_params(include_mtp=False) == 26_895_998_464
