"""Checkpoint loading: real safetensors directories written to tmp_path, broken one way at a time;
each failure is a ModelLoadError whose message names the problem. Sharded checkpoints load like
single files; a checkpoint without mtp.* weights runs with speculation off."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import make_llm
from engine import ModelLoadError, SamplingParams
from engine.config import ModelConfig


@pytest.fixture(scope="module")
def base_tensors(random_hf_model) -> dict[str, torch.Tensor]:
    path, _ = random_hf_model
    return load_file(str(path / "model.safetensors"))


@pytest.fixture
def base(random_hf_model, base_tensors) -> tuple[Path, dict[str, torch.Tensor]]:
    """The random checkpoint's directory and a fresh dict of its tensors (tests break their copy)."""
    return random_hf_model[0], dict(base_tensors)


def write_checkpoint(dst: Path, src: Path, tensors: dict[str, torch.Tensor] | None = None,
                     config: dict | None = None, shards: int = 0) -> Path:
    """A model directory: src's config/tokenizer/generation_config, `tensors` as one file or `shards`."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        tensors = {n: t.contiguous() for n, t in tensors.items()}
        if shards:
            names = sorted(tensors)
            weight_map = {}
            for i in range(shards):
                fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
                part = names[i::shards]
                save_file({n: tensors[n] for n in part}, str(dst / fname))
                weight_map.update({n: fname for n in part})
            (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        else:
            save_file(tensors, str(dst / "model.safetensors"))
    return dst


def load(path: Path, **kw):
    return make_llm(str(path), kv_capacity=1024, **kw)


def test_missing_tensor_is_named(tmp_path, base):
    src, tensors = base
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ModelLoadError, match=r"missing tensors \(1\): model\.layers\.1\.mlp\.up_proj\.weight"):
        load(write_checkpoint(tmp_path / "m", src, tensors))


def test_unexpected_tensor_is_named(tmp_path, base):
    src, tensors = base
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(16)    # old HF buffers are fine
    with pytest.raises(ModelLoadError, match=r"unexpected tensors \(1\): model\.layers\.0\.mlp\.extra_proj\.weight$"):
        load(write_checkpoint(tmp_path / "m", src, tensors))


def test_wrong_shape_is_named_with_both_shapes(tmp_path, base):
    src, tensors = base
    tensors["model.layers.2.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    with pytest.raises(ModelLoadError, match=r"wrong shape tensors \(1\): model\.layers\.2\.self_attn\.k_proj\.weight "
                                             r"\[32, 64\] \(expected \[64, 64\]\)"):
        load(write_checkpoint(tmp_path / "m", src, tensors))


def test_every_problem_in_one_error(tmp_path, base):
    src, tensors = base
    for i in range(10):
        del tensors[f"model.layers.{i % 3}.{['mlp.up_proj', 'mlp.down_proj', 'self_attn.o_proj', 'mlp.gate_proj'][i // 3]}.weight"]
    tensors["lm_head.bias"] = torch.zeros(384)
    tensors["model.norm.weight"] = torch.ones(65)
    with pytest.raises(ModelLoadError) as e:
        load(write_checkpoint(tmp_path / "m", src, tensors))
    msg = str(e.value)
    assert "missing tensors (10):" in msg and "and 2 more" in msg
    assert "unexpected tensors (1): lm_head.bias" in msg
    assert "wrong shape tensors (1): model.norm.weight [65] (expected [64])" in msg


def test_unsupported_model_type(tmp_path, base):
    src, tensors = base
    config = json.loads((src / "config.json").read_text()) | {"model_type": "llama"}
    with pytest.raises(ModelLoadError, match=r"unsupported model_type 'llama'; supported: qwen3"):
        load(write_checkpoint(tmp_path / "m", src, tensors, config=config))


def test_config_lacking_fields(tmp_path, base):
    src, tensors = base
    config = json.loads((src / "config.json").read_text())
    del config["hidden_size"], config["num_hidden_layers"]
    with pytest.raises(ModelLoadError, match=r"config\.json lacks hidden_size, num_hidden_layers"):
        load(write_checkpoint(tmp_path / "m", src, tensors, config=config))


@pytest.mark.parametrize("missing, message", [
    ("config.json", r"no config\.json"),
    ("tokenizer.json", r"no tokenizer\.json"),
    ("model.safetensors", r"no model\.safetensors or model\.safetensors\.index\.json"),
])
def test_missing_files(tmp_path, base, missing, message):
    src, tensors = base
    path = write_checkpoint(tmp_path / "m", src, tensors)
    (path / missing).unlink()
    with pytest.raises(ModelLoadError, match=message):
        load(path)


def test_missing_directory_and_bad_json(tmp_path, base):
    with pytest.raises(ModelLoadError, match=r"does not exist"):
        load(tmp_path / "nowhere")
    src, tensors = base
    path = write_checkpoint(tmp_path / "m", src, tensors)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: not valid JSON"):
        load(path)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path, base):
    src, tensors = base
    single = load(write_checkpoint(tmp_path / "single", src, tensors))
    sharded = load(write_checkpoint(tmp_path / "sharded", src, tensors, shards=3))
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) == 3
    ids = list(range(3, 40))
    assert torch.equal(single.prompt_logits(ids), sharded.prompt_logits(ids))


def test_index_pointing_at_a_missing_shard(tmp_path, base):
    src, tensors = base
    path = write_checkpoint(tmp_path / "m", src, tensors, shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"index names missing shard files: model-00002-of-00002\.safetensors"):
        load(path)


def test_index_listing_a_tensor_its_shard_lacks(tmp_path, base):
    src, tensors = base
    path = write_checkpoint(tmp_path / "m", src, tensors, shards=2)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.phantom.weight"] = "model-00001-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"the index lists model\.layers\.0\.mlp\.phantom\.weight but the file lacks it"):
        load(path)


def test_checkpoint_without_mtp_runs_with_speculation_off(random_hf_model):
    path, _ = random_hf_model
    llm = make_llm(str(path), kv_capacity=1024, draft_tokens=2)
    assert llm.engine.draft_tokens == 0
    out = llm.generate([list(range(1, 30))], SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))[0]
    assert len(out.token_ids) == 6
    assert out.stats.speculative.draft_tokens == 0 and out.stats.speculative.rounds == 0


def test_mtp_weights_are_dropped_when_speculation_is_off(llm_k0):
    assert llm_k0.engine.draft_tokens == 0
    from tests.conftest import runner_of
    assert runner_of(llm_k0.engine).model.mtp is None


def test_eos_ids_come_from_generation_config(tmp_path, base):
    src, tensors = base
    path = write_checkpoint(tmp_path / "m", src, tensors)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert load(path).engine.model_config.eos_token_ids == (2, 0)


def test_rope_settings_in_both_config_formats():
    hf = {"model_type": "qwen3", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
          "num_hidden_layers": 1, "num_attention_heads": 2}
    assert ModelConfig.from_hf(hf | {"rope_theta": 5000.0}).rope_theta == 5000.0                  # transformers 4
    assert ModelConfig.from_hf(hf | {"rope_parameters": {"rope_theta": 7000.0, "rope_type": "default"}}).rope_theta == 7000.0
    assert ModelConfig.from_hf(hf).rope_theta == 1_000_000.0
    with pytest.raises(ModelLoadError, match=r"unsupported rope_type 'yarn'"):
        ModelConfig.from_hf(hf | {"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ModelLoadError, match=r"unsupported rope_type 'linear'"):
        ModelConfig.from_hf(hf | {"rope_scaling": {"type": "linear", "factor": 2.0}})
