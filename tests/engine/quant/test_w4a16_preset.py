"""The bench's INT4 weight-only shapes (`preset:NAME-w4a16`, tools/bench/quant.py's `w4a16` format): random
weights quantized by `engine.quant.int_formats` into compressed-tensors' pack-quantized tensors and loaded
through that layout, as an llmcompressor W4A16 checkpoint would be."""

from __future__ import annotations

import torch

from engine.loading.checkpoint import RandomWeights
from engine.loading.presets import preset
from engine.quant import int_formats
from engine.quant.layouts.base import INT, LinearQuant
from engine.quant.random_weights import RandomQuantWeights


def test_w4a16_preset_quantizes_every_linear_to_int4_groups_of_128():
    cfg = preset("tiny-w4a16")
    scheme = cfg.quant
    assert scheme.format == "compressed-tensors" and len(scheme.modules) > 0
    assert {scheme.spec(m) for m in scheme.modules} == {LinearQuant(INT, 4, 128)}
    assert not any(m.endswith(("embed_tokens", "lm_head")) for m in scheme.modules)


def test_random_w4a16_tensors_have_the_declared_shapes_and_dequantize_to_the_bf16_draw():
    weights = RandomQuantWeights.for_model(preset("tiny-w4a16"), "cpu")
    bf16 = dict(RandomWeights(weights._shapes, "cpu", weights.seed))   # the same draw, unquantized
    got = dict(weights)
    assert {n: tuple(t.shape) for n, t in got.items()} == weights.shapes()
    module = "model.layers.0.mlp.down_proj"
    w = bf16[f"{module}.weight"].float()                                # [out, in]
    scale = got[f"{module}.weight_scale"].float()                       # [out, in/128]
    deq = int_formats.dequantize_int(got[f"{module}.weight_packed"], scale, torch.full_like(scale, 8.0), 4, 128)
    step = scale.repeat_interleave(128, dim=1)
    err = (deq - w).abs()
    # half a step, but a whole one at a group's positive extreme (absmax / 8 steps: +8 clamps to +7), plus the
    # scale's bf16 rounding
    assert (err <= step + w.abs() * 2 ** -7).all() and (err <= step * 0.5 + w.abs() * 2 ** -7).float().mean() > 0.99
    assert got[f"{module}.weight_shape"].tolist() == list(w.shape)


def test_w4a16_preset_loads_through_the_compressed_tensors_layout_and_runs():
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    llm = LLM("preset:tiny-w4a16", dtype="float32", kv_capacity=1024)
    out = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    assert torch.isfinite(llm.prompt_logits("hello world")).all()
