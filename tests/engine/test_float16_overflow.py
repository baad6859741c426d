"""--dtype float16 on checkpoints whose activations leave float16's range, where bfloat16-trained Qwen models
leave it (QwenLM/Qwen3 issues 826, 868; ggml-org/llama.cpp PR 27016): the residual stream, kept in float32
(engine.layers.norm), and the dense MLP's SwiGLU product, computed in float32 and rescaled per row before
down_proj (engine.layers.mlp). Each case is a shared model rewritten so that its function is unchanged (powers
of two, float32 storage: exact) while the activation goes beyond 65504; float16 must run it with no non-finite
position and agree with float32 as it does on the shared model.

- The stream: the embedding and every projection that writes into the stream times k (every reader of the
  stream is an RMSNorm, which is scale-invariant). k is chosen from the shared models' measured headroom
  (tools/dev/float16_headroom.py, 2026-12-05, float32, its eight prompts and 32 greedy tokens): final stream
  258.5 / largest projection output 145.9 (Qwen3), 461.9 / 378.8 (Qwen3.5), so that the scaled stream leaves
  float16's range while no projection's output does.
- The SwiGLU: the neuron with the largest product (layer 3 neuron 486 of the tiny Qwen3 at 170, layer 7 neuron
  272 of the tiny Qwen3.5 at 159.5) gets its up_proj row times 1024 and its down_proj column divided by 1024.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from engine.loading.checkpoint import FLOAT16_MAX
from engine.sampling_params import SamplingParams
from tests.conftest import make_llm, require_shared_model
from tests.engine.test_float16 import assert_logits_close
from tools.dev.capability_check import PROMPTS
from tools.dev.float16_headroom import measure

# k per shared model: its final stream x k > 65504 > its largest projection output x k
SCALES = {"tiny-qwen3-mtp": 320, "tiny-qwen3_5-mtp": 160}
NEURON_SCALE = 1024          # the largest product x 1024 > 65504; that neuron's up_proj output x 1024 < 65504
WRITES_TO_STREAM = re.compile(r"model\.layers\.\d+\.(self_attn\.o_proj|linear_attn\.out_proj|mlp\.down_proj)\.weight")


def rewritten_copy(src: Path, dst: Path, rewrite) -> Path:
    """A float32 copy of checkpoint `src` with `rewrite(tensors)` applied to each shard's tensors (in place); a tied
    LM head is untied first."""
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
        rewrite(tensors)
        save_file(tensors, dst / shard.name, metadata={"format": "pt"})
    if tied:
        text["tie_word_embeddings"] = config["tie_word_embeddings"] = False
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    if index is not None:
        index_file.write_text(json.dumps(index, indent=2))
    return dst


def scaled_stream_copy(src: Path, dst: Path, scale: int) -> Path:
    """`src` with its decoder residual stream `scale` times the original (the MTP layer's own stream starts from
    its fc output, so it is left as it is)."""
    def rewrite(tensors):
        for name, t in tensors.items():
            if name == "model.embed_tokens.weight" or WRITES_TO_STREAM.fullmatch(name):
                t.mul_(scale)
    return rewritten_copy(src, dst, rewrite)


def massive_neuron_copy(src: Path, dst: Path, layer: int, neuron: int, scale: int) -> Path:
    """`src` with one SwiGLU neuron's product `scale` times the original and its down_proj column divided by it."""
    prefix = f"model.layers.{layer}.mlp"
    def rewrite(tensors):
        if f"{prefix}.up_proj.weight" in tensors:
            tensors[f"{prefix}.up_proj.weight"][neuron].mul_(scale)
        if f"{prefix}.down_proj.weight" in tensors:
            tensors[f"{prefix}.down_proj.weight"][:, neuron].div_(scale)
    return rewritten_copy(src, dst, rewrite)


def runs_of(models: dict[str, tuple[Path, str]]) -> dict[str, tuple]:
    """label -> (greedy continuations, prompt logits, Headroom, ModelInfo) of each (checkpoint, dtype), on the CPU
    (eager: the probe's hooks see every step)."""
    runs = {}
    for label, (path, dtype) in models.items():
        llm = make_llm(str(path), dtype=dtype, device="cpu")
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0.0))
        logits = [llm.prompt_logits(p).float() for p in PROMPTS]
        runs[label] = ([o.outputs[0].token_ids for o in outs], logits, measure(llm), llm.engine.info())
    return runs


def assert_agrees_with_float32(ref, half) -> None:
    """As the shared models in float16 agree with float32 (tests/engine/test_float16.py)."""
    assert_logits_close(ref[1], half[1])
    identical = sum(a == b for a, b in zip(ref[0], half[0]))
    assert identical >= 6, (identical, ref[0], half[0])


@pytest.fixture(scope="module", params=sorted(SCALES))
def shared(request) -> tuple[str, Path]:
    return request.param, Path(require_shared_model().replace("tiny-qwen3-mtp", request.param))


@pytest.fixture(scope="module")
def reference(shared):
    return runs_of({"reference": (shared[1], "float32")})["reference"]


@pytest.fixture(scope="module")
def scaled_runs(shared, reference, tmp_path_factory):
    name, src = shared
    scaled = scaled_stream_copy(src, tmp_path_factory.mktemp("scaled") / name, SCALES[name])
    runs = runs_of({"scaled-float32": (scaled, "float32"), "scaled-float16": (scaled, "float16")})
    runs["reference"], runs["scale"] = reference, SCALES[name]
    return runs


def test_the_shared_models_headroom_is_as_measured(scaled_runs):
    found = scaled_runs["reference"][2]
    scale = scaled_runs["scale"]
    largest_output = max(found.writer_peak, *found.mlp_outputs.values())
    assert found.stream_peak * scale > FLOAT16_MAX > largest_output * scale, (found.stream_peak, largest_output)
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
    assert_agrees_with_float32(scaled_runs["reference"], scaled_runs["scaled-float16"])


def test_the_scaled_model_is_the_shared_models_function(scaled_runs):
    """The premise: scaling the stream changes nothing a reader sees (up to RMSNorm's eps and float32 rounding)."""
    ref_tokens, ref_logits, ref_found = scaled_runs["reference"][:3]
    tokens, logits, found = scaled_runs["scaled-float32"][:3]
    assert tokens == ref_tokens
    for a, b in zip(ref_logits, logits):
        assert float((a - b).abs().max() / a.abs().max()) < 1e-3
    assert found.stream_peak == pytest.approx(scaled_runs["scale"] * ref_found.stream_peak, rel=1e-3)


@pytest.fixture(scope="module")
def massive_neuron_runs(shared, reference, tmp_path_factory):
    name, src = shared
    swiglu = reference[2].swiglu
    layer = max(swiglu, key=lambda i: swiglu[i][0])
    peak, neuron = swiglu[layer]
    copy = massive_neuron_copy(src, tmp_path_factory.mktemp("neuron") / name, layer, neuron, NEURON_SCALE)
    runs = runs_of({"massive-float32": (copy, "float32"), "massive-float16": (copy, "float16")})
    runs["reference"], runs["site"] = reference, (layer, neuron, peak)
    return runs


def test_float16_rescales_a_swiglu_product_beyond_its_range(massive_neuron_runs):
    layer, neuron, peak = massive_neuron_runs["site"]
    massive = massive_neuron_runs["massive-float32"][2]
    assert massive.swiglu[layer] == (pytest.approx(peak * NEURON_SCALE, rel=1e-3), neuron)
    assert massive.swiglu_peak > FLOAT16_MAX                           # float16 would round it to inf
    assert "SwiGLU product reaches" in massive.verdict()
    half = massive_neuron_runs["massive-float16"]
    # what down_proj received in float16: each row divided by its power of two, to 4096 or below
    assert half[2].swiglu[layer][0] <= 4096 and half[2].nonfinite_rows == 0
    assert_agrees_with_float32(massive_neuron_runs["massive-float32"], half)
    assert_agrees_with_float32(massive_neuron_runs["reference"], half)


def test_the_massive_neuron_copy_is_the_shared_models_function(massive_neuron_runs):
    ref, massive = massive_neuron_runs["reference"], massive_neuron_runs["massive-float32"]
    assert massive[0] == ref[0]
    for a, b in zip(ref[1], massive[1]):
        assert float((a - b).abs().max() / a.abs().max()) < 1e-4


def test_a_float16_output_beyond_its_range_is_named_by_the_verdict():
    from tools.dev.float16_headroom import Headroom
    found = Headroom()
    found.stream[0], found.writers["0.self_attn.o_proj"], found.writers["1.linear_attn.out_proj"] = 9e4, 7e4, 10.0
    assert found.verdict().startswith("0.self_attn.o_proj writes 70000, beyond float16's 65504")
