"""`--quantization fp8 | ptpc_fp8`: an unquantized checkpoint's linear layers quantized while they load.

fp8 (128x128 blocks) must equal the checkpoint `ninfer quantize --format fp8` writes (the same quantizer, never
written here); ptpc_fp8 (a scale per output row) must equal the float32 model whose weights a plain per-row
quantization written in this test rounds; both with TP=2 and with the MTP layer quantized too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import assert_kv_idle, make_llm
from engine import InvalidArgumentError, ModelLoadError, SamplingParams
from engine.quant.quantize import quantize_checkpoint

PROMPTS = ["def fibonacci(n):\n    if n < 2:", [5, 9, 77, 300, 12, 8, 41, 7, 250, 3, 3, 3, 199]]


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def per_row_fp8_twin(src: Path, dst: Path) -> Path:
    """`src` with every 2-D weight but the embeddings rounded to e4m3 with one absmax scale per row, as float32."""
    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        t = load_file(str(file))
        for name, w in t.items():
            if name.endswith(".weight") and w.dim() == 2 and name not in ("model.embed_tokens.weight", "lm_head.weight"):
                w = w.float()
                scale = w.abs().amax(1, keepdim=True) / 448.0
                t[name] = (w / scale).to(torch.float8_e4m3fn).float() * scale
        save_file(t, str(file))
    return dst


def test_fp8_at_load_equals_the_quantize_tool(random_hf_model, tmp_path):
    src = random_hf_model[0]
    files = sorted(p.name for p in src.iterdir())
    quantize_checkpoint(src, tmp_path / "q", "fp8")
    online = make_llm(str(src), kv_capacity=1024, quantization="fp8")
    offline = make_llm(str(tmp_path / "q"), kv_capacity=1024)
    scheme = online.engine.model_config.quant
    assert scheme.format == "fp8" and len(scheme.modules) == 3 * 7
    layer = online.engine.executor.driver.model.model.layers[0].mlp.down_proj
    assert layer.quant == "fp8" and layer.weight.dtype == torch.float8_e4m3fn
    for prompt in PROMPTS:
        assert rel_diff(online.prompt_logits(prompt), offline.prompt_logits(prompt)) < 1e-6
    assert sorted(p.name for p in src.iterdir()) == files                   # nothing written beside the model
    full = make_llm(str(src), kv_capacity=1024).engine.memory.weights_bytes
    assert online.engine.memory.weights_bytes < 0.85 * full


def test_ptpc_fp8_equals_a_per_row_rounding(random_hf_model, tmp_path):
    src = random_hf_model[0]
    online = make_llm(str(src), kv_capacity=1024, quantization="ptpc_fp8")
    twin = make_llm(str(per_row_fp8_twin(src, tmp_path / "twin")), kv_capacity=1024)
    assert online.engine.executor.driver.model.model.layers[1].self_attn.qkv_proj.quant == "fp8_channel"
    for prompt in PROMPTS:
        assert rel_diff(online.prompt_logits(prompt), twin.prompt_logits(prompt)) < 1e-5


@pytest.mark.parametrize("method", ["fp8", "ptpc_fp8"])
def test_tp2_and_the_quantized_mtp_layer(shared_model, method):
    """The shared model (trained: MTP acceptance well above 0) with its MTP layer quantized too: TP=2 equals
    TP=1 and greedy k=3 equals k=0."""
    one = make_llm(shared_model, quantization=method)
    two = make_llm(shared_model, quantization=method, tensor_parallel_size=2)
    for prompt in PROMPTS:
        assert rel_diff(two.prompt_logits(prompt), one.prompt_logits(prompt)) < 1e-5
    k3 = make_llm(shared_model, quantization=method, draft_tokens=3)
    assert k3.engine.executor.driver.model.mtp.fc.quant is not None
    greedy = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    outs = k3.generate(PROMPTS, greedy)
    assert [o.token_ids for o in outs] == [o.token_ids for o in one.generate(PROMPTS, greedy)]
    assert sum(o.stats.speculative.accepted for o in outs) > 0
    assert_kv_idle(k3.engine)


def test_an_already_quantized_checkpoint_is_refused(random_hf_model, tmp_path):
    quantize_checkpoint(random_hf_model[0], tmp_path / "q", "nvfp4")
    with pytest.raises(ModelLoadError, match=r"--quantization fp8: the checkpoint is already quantized \(nvfp4\)"):
        make_llm(str(tmp_path / "q"), kv_capacity=1024, quantization="fp8")
    with pytest.raises(InvalidArgumentError, match="quantization"):
        make_llm(str(random_hf_model[0]), kv_capacity=1024, quantization="int4")


def test_the_flag_reaches_the_engine_config():
    import argparse

    from ninfer.cli import flags
    p = argparse.ArgumentParser()
    flags.add_engine_args(p)
    cfg = flags.engine_config_from_args(p.parse_args(["--quantization", "ptpc_fp8", "--device", "cpu"]))
    assert cfg.quantization == "ptpc_fp8"
    with pytest.raises(SystemExit):
        p.parse_args(["--quantization", "awq"])
