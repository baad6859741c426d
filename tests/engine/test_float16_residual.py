"""The float32 residual stream of --dtype float16 (engine.layers.norm): a model whose residual stream exceeds
float16's range runs in float16 and agrees with float32.

The checkpoint is a shared model with its residual stream scaled by k: the embedding and every projection that
writes into the stream (o_proj, the Gated DeltaNet's out_proj, down_proj) times k, stored in float32. Every
reader of the stream is an RMSNorm, which is scale-invariant, so the scaled model computes the shared model's
function; k = 5 x 2^n scales bf16 weights exactly in float32 and in float16. k is chosen from the shared models'
measured headroom (tools/dev/float16_headroom.py, 2026-12-05, float32, its eight prompts and 32 greedy tokens):
final stream 258.5 / largest projection output 145.9 (Qwen3), 461.9 / 378.8 (Qwen3.5), so that the scaled stream
leaves float16's range while no projection's output does. That is the case the float32 stream is for: Qwen-class
checkpoints trained in bfloat16 whose residual streams carry values beyond 65504 (QwenLM/Qwen3 issues 826, 868).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.loading.checkpoint import FLOAT16_MAX
from engine.sampling_params import SamplingParams
from tests.conftest import make_llm, require_shared_model
from tools.dev.float16_headroom import PROMPTS, measure

# k per shared model: its final stream x k > 65504 > its largest projection output x k
SCALES = {"tiny-qwen3-mtp": 320, "tiny-qwen3_5-mtp": 160}
WRITES_TO_STREAM = re.compile(r"model\.layers\.\d+\.(self_attn\.o_proj|linear_attn\.out_proj|mlp\.down_proj)\.weight")


def scaled_stream_copy(src: Path, dst: Path, scale: int) -> Path:
    """A float32 copy of checkpoint `src` whose decoder residual stream is `scale` times the original (the MTP
    layer's own stream starts from its fc output, so it is left as it is). A tied LM head is untied first."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    text = config.get("text_config", config)
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    index_file = dst / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.exists() else None
    for shard in sorted(src.glob("*.safetensors")):
        tensors = {name: t.float() for name, t in load_file(shard).items()}
        if tied and "model.embed_tokens.weight" in tensors:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
            if index is not None:
                index["weight_map"]["lm_head.weight"] = shard.name
        for name, t in tensors.items():
            if name == "model.embed_tokens.weight" or WRITES_TO_STREAM.fullmatch(name):
                tensors[name] = t * scale
        save_file(tensors, dst / shard.name, metadata={"format": "pt"})
    if tied:
        text["tie_word_embeddings"] = config["tie_word_embeddings"] = False
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    if index is not None:
        index_file.write_text(json.dumps(index, indent=2))
    return dst


@pytest.fixture(scope="module", params=sorted(SCALES))
def scaled_runs(request, tmp_path_factory):
    src = Path(require_shared_model().replace("tiny-qwen3-mtp", request.param))
    scaled = scaled_stream_copy(src, tmp_path_factory.mktemp("scaled") / request.param, SCALES[request.param])
    runs = {}
    for label, path, dtype in (("reference", src, "float32"), ("scaled-float32", scaled, "float32"),
                               ("scaled-float16", scaled, "float16")):
        llm = make_llm(str(path), dtype=dtype, device="cpu")      # eager: the probe's hooks see every step
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0.0))
        logits = [llm.prompt_logits(p).float() for p in PROMPTS]
        runs[label] = ([o.outputs[0].token_ids for o in outs], logits, measure(llm), llm.engine.info())
    runs["scale"] = SCALES[request.param]
    return runs


def test_the_shared_models_headroom_is_as_measured(scaled_runs):
    found = scaled_runs["reference"][2]
    scale = scaled_runs["scale"]
    assert found.stream_peak * scale > FLOAT16_MAX > found.writer_peak * scale, (found.stream_peak, found.writer_peak)
    assert found.stream_dtypes == {"float32"} and found.nonfinite_rows == 0 and "fits float16" in found.verdict()


def test_float16_holds_a_stream_beyond_its_range_in_float32(scaled_runs):
    tokens, logits, found, info = scaled_runs["scaled-float16"]
    assert dict(info.kernel_paths)["residual_dtype"] == "float32"
    assert found.stream_dtypes == {"float32"}
    assert found.stream_peak > FLOAT16_MAX > found.writer_peak, found.as_dict()
    # a float16 stream would hold inf there; measured with one (2026-12-05): 1 (Qwen3) and 2 (Qwen3.5) token
    # positions end non-finite in these runs, and Qwen3.5's greedy output then differs from float32's
    assert found.nonfinite_rows == 0
    assert "float16 runs only because the engine keeps the stream in float32" in found.verdict()
    ref_tokens, ref_logits = scaled_runs["reference"][:2]
    for a, b in zip(ref_logits, logits):
        assert torch.isfinite(b).all()
        assert float((a - b).abs().max() / a.abs().max()) < 0.005
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    identical = sum(a == b for a, b in zip(ref_tokens, tokens))
    assert identical >= 6, (identical, ref_tokens, tokens)


def test_the_scaled_model_is_the_shared_models_function(scaled_runs):
    """The premise: scaling the stream changes nothing a reader sees (up to RMSNorm's eps and float32 rounding)."""
    ref_tokens, ref_logits, ref_found = scaled_runs["reference"][:3]
    tokens, logits, found = scaled_runs["scaled-float32"][:3]
    assert tokens == ref_tokens
    for a, b in zip(ref_logits, logits):
        assert float((a - b).abs().max() / a.abs().max()) < 1e-3
    assert found.stream_peak == pytest.approx(scaled_runs["scale"] * ref_found.stream_peak, rel=1e-3)


def test_a_projection_beyond_float16_is_named_by_the_verdict():
    from tools.dev.float16_headroom import Headroom
    found = Headroom()
    found.stream[0], found.writers["0.mlp.down_proj"], found.writers["0.self_attn.o_proj"] = 9e4, 7e4, 10.0
    assert found.verdict().startswith("0.mlp.down_proj writes 70000, beyond float16's 65504")
