"""--dtype float16 end to end on the CPU (the dtype of GPUs without bfloat16, sm70/sm75): bf16 checkpoints convert
at load with every tensor's range checked, and the shared models' outputs stay close to float32's."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import ModelLoadError
from engine.loading.checkpoint import FLOAT16_MAX, checked_for_float16
from engine.sampling_params import SamplingParams
from tests.conftest import make_llm, require_shared_model
from tools.dev.capability_check import PROMPTS      # the prompts the GPU check compares on



def assert_logits_close(ref: list[torch.Tensor], half: list[torch.Tensor]) -> None:
    """Each prompt's float16 logits [P, vocab] finite, within 0.5 % of float32's largest, with the same top-1."""
    for a, b in zip(ref, half):
        assert torch.isfinite(b).all()
        assert float((a - b).abs().max() / a.abs().max()) < 0.005
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_a_tensor_beyond_float16s_range_is_refused_by_name():
    ok = ("model.norm.weight", torch.full((4,), 60000.0, dtype=torch.bfloat16))
    big = ("model.layers.3.mlp.down_proj.weight", torch.tensor([[1.0, -70000.0]], dtype=torch.bfloat16))
    assert [n for n, _ in checked_for_float16([ok])] == ["model.norm.weight"]
    with pytest.raises(ModelLoadError) as e:
        list(checked_for_float16([ok, big]))
    assert "model.layers.3.mlp.down_proj.weight" in str(e.value) and "65504" in str(e.value)
    # codes and FP8 scales pass: they are not floating point or cannot exceed the range
    codes = ("w", torch.full((2,), 255, dtype=torch.uint8))
    assert len(list(checked_for_float16([codes, ("s", torch.ones(2, dtype=torch.float8_e4m3fn))]))) == 2
    assert FLOAT16_MAX == float(torch.finfo(torch.float16).max)


def test_an_engine_in_float16_refuses_a_checkpoint_with_an_overflowing_weight(random_hf_model, tmp_path):
    import shutil
    src, _ = random_hf_model
    dst = tmp_path / "overflow"
    shutil.copytree(src, dst)
    file = dst / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.1.self_attn.o_proj.weight"][0, 0] = 1e6
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.o_proj\.weight: holds 1e\+06"):
        make_llm(str(dst), dtype="float16")
    assert make_llm(str(dst), dtype="float32").engine.info().dtype == "float32"   # the same file loads in float32


@pytest.fixture(scope="module", params=["tiny-qwen3-mtp", "tiny-qwen3_5-mtp"])
def float16_vs_float32(request):
    path = require_shared_model().replace("tiny-qwen3-mtp", request.param)
    runs = {}
    for dtype, kv_dtype in (("float32", "auto"), ("float16", "auto"), ("float16", "int8")):
        llm = make_llm(path, dtype=dtype, kv_dtype=kv_dtype)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0.0))
        runs[dtype if kv_dtype == "auto" else f"{dtype}-{kv_dtype}"] = ([o.outputs[0].token_ids for o in outs], [llm.prompt_logits(p).float() for p in PROMPTS],
                       llm.engine.info())
    return runs


def test_float16_greedy_output_agrees_with_float32(float16_vs_float32):
    """Measured 2026-12-05 with the float32 residual stream and SwiGLU (engine.layers.norm, engine.layers.mlp):
    8 of 8 greedy continuations (32 tokens) identical for Qwen3, 7 of 8 for Qwen3.5, whose other splits after 28
    identical tokens where float16 rounding flips a near tie (both in float16: 7 of 8 for both)."""
    ref, half = float16_vs_float32["float32"][0], float16_vs_float32["float16"][0]
    identical = sum(a == b for a, b in zip(ref, half))
    assert identical >= 6, (identical, ref, half)
    first_split = [next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), len(a)) for a, b in zip(ref, half)]
    assert min(first_split) >= 4, first_split


def test_float16_logits_are_close_to_float32(float16_vs_float32):
    """Measured: max |logit error| / max |logit| 0.00084 (Qwen3), 0.00072 (Qwen3.5) with the float32 stream and
    SwiGLU (0.00111, 0.00085 with both in float16); every prompt position's top-1 equal."""
    assert_logits_close(float16_vs_float32["float32"][1], float16_vs_float32["float16"][1])
    info = float16_vs_float32["float16"][2]
    assert info.dtype == "float16" and dict(info.kernel_paths)["dtype"] == "float16"


def test_float16_with_int8_kv_the_seeds_setting_stays_close_to_float32(float16_vs_float32):
    """Measured 2026-12-05: 5 of 8 greedy continuations identical for Qwen3 (one prompt's last position flips a
    near tie, float32's top two 0.028 apart at 7.16, and with it that prompt's first token), 7 of 8 for Qwen3.5."""
    ref, half = float16_vs_float32["float32"], float16_vs_float32["float16-int8"]
    assert sum(a == b for a, b in zip(ref[0], half[0])) >= 5
    top1 = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(ref[1], half[1]))
    positions = sum(a.shape[0] for a in ref[1])
    print(f"float16 + int8 KV: top-1 {top1}/{positions}, identical greedy "
          f"{sum(a == b for a, b in zip(ref[0], half[0]))}/{len(PROMPTS)}")
    assert top1 >= positions - 2
    assert half[2].kv_dtype == "int8"
