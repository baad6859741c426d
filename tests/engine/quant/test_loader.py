"""Quantized checkpoints written by the quantize tool, loaded by the engine: the engine's logits equal
those of the same checkpoint dequantized by the reference and loaded as float32; TP=2 shards the
packed weights and scales; every unsupported layout is refused naming the tensor or field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import assert_kv_idle, make_llm
from engine import ModelLoadError, SamplingParams
from engine.quant import formats
from engine.quant.quantize import main, quantize_checkpoint

PROMPTS = ["def fibonacci(n):\n    if n < 2:", [5, 9, 77, 300, 12, 8, 41, 7, 250, 3, 3, 3, 199]]


def dequantize_dir(src: Path, dst: Path) -> Path:
    """`src` (quantized) as a float32 checkpoint, every quantized layer dequantized by the reference."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "hf_quant_config.json").unlink(missing_ok=True)
    for file in dst.glob("*.safetensors"):
        t = load_file(str(file))
        out = {}
        for name, x in t.items():
            module = name[:-len(".weight")]
            if f"{module}.weight_scale_inv" in t:
                out[name] = formats.dequantize_fp8_block(x, t[f"{module}.weight_scale_inv"])
            elif f"{module}.weight_scale_2" in t:
                out[name] = formats.dequantize_nvfp4(x, t[f"{module}.weight_scale"], t[f"{module}.weight_scale_2"])
            elif not name.endswith(("_scale", "_scale_2", "_scale_inv")):
                out[name] = x.float()
        file.unlink()
        save_file(out, str(file))
    if (dst / "model.safetensors.index.json").exists():
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        index["weight_map"] = {n: f for n, f in index["weight_map"].items()
                               if not n.endswith(("_scale", "_scale_2", "_scale_inv"))}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module", params=["fp8", "nvfp4"])
def random_pair(request, random_hf_model, tmp_path_factory):
    """(quantized dir, its reference-dequantized float32 dir) of the random tiny Qwen3."""
    root = tmp_path_factory.mktemp(f"q-{request.param}")
    q = root / "q"
    quantize_checkpoint(random_hf_model[0], q, request.param)
    return request.param, q, dequantize_dir(q, root / "ref")


def test_engine_logits_equal_the_reference_dequantized_model(random_pair):
    fmt, q, ref = random_pair
    quant, plain = make_llm(str(q), kv_capacity=1024), make_llm(str(ref), kv_capacity=1024)
    assert quant.engine.model_config.quant.format == fmt
    assert len(quant.engine.model_config.quant.modules) == 3 * 7
    for prompt in PROMPTS:
        assert rel_diff(quant.prompt_logits(prompt), plain.prompt_logits(prompt)) < 1e-5


def test_quantized_weights_take_fewer_bytes_in_the_plan(random_pair, random_hf_model):
    fmt, q, _ = random_pair
    full = make_llm(str(random_hf_model[0]), kv_capacity=1024).engine.memory.weights_bytes
    quant = make_llm(str(q), kv_capacity=1024).engine.memory.weights_bytes
    assert quant < full * (0.85 if fmt == "fp8" else 0.75)     # float32 embeddings and lm_head stay


@pytest.fixture(scope="module", params=["fp8", "nvfp4"])
def shared_pair(request, shared_model, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"shared-{request.param}")
    quantize_checkpoint(Path(shared_model), root / "q", request.param)
    return request.param, root / "q", dequantize_dir(root / "q", root / "ref")


def test_tp2_shards_packed_weights_and_scales(shared_pair):
    """The shared model's k/v (64 rows per rank) and o_proj (192 columns per rank) cut FP8 blocks."""
    _, q, ref = shared_pair
    plain = make_llm(str(ref))
    two = make_llm(str(q), tensor_parallel_size=2)
    for prompt in PROMPTS:
        assert rel_diff(two.prompt_logits(prompt), plain.prompt_logits(prompt)) < 1e-5


def test_mtp_layer_is_quantized_and_speculation_matches_the_reference(shared_pair):
    _, q, ref = shared_pair
    quant = make_llm(str(q), draft_tokens=3)
    assert any(m.startswith("mtp.layers.0.") for m in quant.engine.model_config.quant.modules)
    assert quant.engine.executor.driver.model.mtp.fc.quant is not None
    greedy = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    got = [o.token_ids for o in quant.generate(PROMPTS, greedy)]
    want = [o.token_ids for o in make_llm(str(ref), draft_tokens=3).generate(PROMPTS, greedy)]
    assert got == want
    assert_kv_idle(quant.engine)


def test_keep_mtp_leaves_the_mtp_layer_unquantized(shared_model, tmp_path):
    assert main(["--format", "nvfp4", "--model", shared_model, "--out", str(tmp_path / "q"), "--keep-mtp"]) == 0
    hf_quant = json.loads((tmp_path / "q/hf_quant_config.json").read_text())["quantization"]
    assert hf_quant == {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                        "exclude_modules": ["lm_head", "mtp"]}
    llm = make_llm(str(tmp_path / "q"), draft_tokens=2)
    modules = llm.engine.model_config.quant.modules
    assert modules and not any(m.startswith("mtp") for m in modules)
    assert llm.engine.executor.driver.model.mtp.fc.quant is None
    assert len(llm.generate(["1. item 1\n2."], SamplingParams(max_tokens=8, temperature=0.0))[0].token_ids) == 8


# -- refusals ------------------------------------------------------------------------------------------

def _rewrite(q: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    shutil.copytree(q, dst)
    if edit_tensors:
        t = load_file(str(dst / "model.safetensors"))
        edit_tensors(t)
        save_file({n: x.contiguous() for n, x in t.items()}, str(dst / "model.safetensors"))
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
        (dst / "hf_quant_config.json").unlink(missing_ok=True)
    return dst


L0 = "model.layers.0"


@pytest.mark.parametrize("fmt, edit, message", [
    ("nvfp4", lambda t: t.update({f"{L0}.mlp.up_proj.weight_scale": t[f"{L0}.mlp.up_proj.weight_scale"].to(torch.bfloat16)}),
     f"{L0}.mlp.up_proj.weight_scale is BF16 (the nvfp4 layout needs F8_E4M3)"),
    ("fp8", lambda t: t.update({f"{L0}.self_attn.o_proj.weight": t[f"{L0}.self_attn.o_proj.weight"].float()}),
     f"{L0}.self_attn.o_proj.weight is F32 (the fp8 layout needs F8_E4M3)"),
    ("fp8", lambda t: t.pop(f"{L0}.self_attn.k_proj.weight_scale_inv"),
     f"{L0}.self_attn.q_proj (quantized), {L0}.self_attn.k_proj (not)"),
    ("nvfp4", lambda t: t.pop(f"{L0}.mlp.down_proj.weight_scale_2"),
     f"missing tensors (1): {L0}.mlp.down_proj.weight_scale_2"),
    ("fp8", lambda t: t.update({f"{L0}.mlp.down_proj.weight_scale_inv": torch.ones(2, 2)}),
     f"{L0}.mlp.down_proj.weight_scale_inv [2, 2] (expected [1, 2])"),
])
def test_bad_tensors_are_refused_by_name(random_hf_model, tmp_path, fmt, edit, message):
    quantize_checkpoint(random_hf_model[0], tmp_path / "q", fmt)
    bad = _rewrite(tmp_path / "q", tmp_path / "bad", edit_tensors=edit)
    with pytest.raises(ModelLoadError) as e:
        make_llm(str(bad), kv_capacity=1024)
    assert message in str(e.value)


@pytest.mark.parametrize("fmt, edit, message", [
    ("nvfp4", lambda c: c.update(group_size=32), "quantization_config.group_size=32"),
    ("nvfp4", lambda c: c.update(quant_algo="W4A8_AWQ"), "quantization_config.quant_algo='W4A8_AWQ'"),
    ("nvfp4", lambda c: c.update(kv_cache_quant_algo="FP8"), "quantization_config.kv_cache_quant_algo='FP8'"),
    ("nvfp4", lambda c: c.update(exclude_modules=["lm_head", "model.layers.*.mlp.*"]),
     "model.layers.0.mlp.down_proj.weight_scale: the module is in exclude_modules"),
    ("fp8", lambda c: c.update(weight_block_size=[64, 64]), "quantization_config.weight_block_size=[64, 64]"),
    ("fp8", lambda c: c.update(activation_scheme="static"), "quantization_config.activation_scheme='static'"),
    ("fp8", lambda c: c.update(quant_method="bitsandbytes"), "quantization_config.quant_method='bitsandbytes'"),
])
def test_bad_configs_are_refused_by_field(random_hf_model, tmp_path, fmt, edit, message):
    quantize_checkpoint(random_hf_model[0], tmp_path / "q", fmt)
    bad = _rewrite(tmp_path / "q", tmp_path / "bad", edit_config=edit)
    with pytest.raises(ModelLoadError) as e:
        make_llm(str(bad), kv_capacity=1024)
    assert message in str(e.value)


def test_modelopt_hf_quant_config_alone_is_read(random_hf_model, tmp_path):
    quantize_checkpoint(random_hf_model[0], tmp_path / "q", "nvfp4")
    cfg = json.loads((tmp_path / "q/config.json").read_text())
    cfg.pop("quantization_config")
    (tmp_path / "q/config.json").write_text(json.dumps(cfg))
    assert make_llm(str(tmp_path / "q"), kv_capacity=1024).engine.model_config.quant.format == "nvfp4"


def test_quantize_tool_refuses_quantized_input_and_a_full_output(random_hf_model, tmp_path, capsys):
    src = str(random_hf_model[0])
    assert main(["--format", "fp8", "--model", src, "--out", str(tmp_path / "a")]) == 0
    assert "21 linear layers in fp8" in capsys.readouterr().out
    assert main(["--format", "fp8", "--model", src, "--out", str(tmp_path / "a")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["--format", "nvfp4", "--model", str(tmp_path / "a"), "--out", str(tmp_path / "b")]) == 2
    assert "quantization_config is set" in capsys.readouterr().err
    t = load_file(str(tmp_path / "a/model.safetensors"))
    assert t["lm_head.weight"].dtype == torch.float32 and t["model.embed_tokens.weight"].dtype == torch.float32
    assert t[f"{L0}.mlp.up_proj.weight"].dtype == formats.FP8
    assert t[f"{L0}.mlp.up_proj.weight_scale_inv"].shape == (2, 1)          # [ceil(160/128), ceil(64/128)]


def test_quantize_parser_builds_without_torch():
    """`ninfer quantize` can join the torch-free command line: the parser needs no torch."""
    import subprocess
    import sys
    code = ("import sys\nsys.modules['torch'] = None\nimport argparse\n"
            "from engine.quant.quantize import build_parser\n"
            "p = build_parser(argparse.ArgumentParser(prog='ninfer quantize'))\n"
            "a = p.parse_args(['--format', 'fp8', '--model', 'm', '--out', 'o'])\nprint(a.format, a.scale_search)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[3], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "fp8 False"


def test_ninfer_quantize_subcommand_writes_a_checkpoint_the_engine_loads(random_hf_model, tmp_path):
    import subprocess
    import sys
    out = tmp_path / "fp8"
    done = subprocess.run([sys.executable, "-m", "ninfer", "quantize", "--format", "fp8", "--model",
                           str(random_hf_model[0]), "--out", str(out)], cwd=Path(__file__).resolve().parents[3],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    refused = subprocess.run([sys.executable, "-m", "ninfer", "quantize", "--format", "fp8", "--model",
                              str(tmp_path / "missing"), "--out", str(tmp_path / "x")],
                             cwd=Path(__file__).resolve().parents[3], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr


def test_quantized_files_are_readable_by_other_users(random_hf_model, tmp_path):
    """safetensors writes 0600; `ninfer quantize`'s files take the mode new files get under the umask."""
    import os
    import stat
    old = os.umask(0o022)
    try:
        quantize_checkpoint(random_hf_model[0], tmp_path / "q", "nvfp4")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "q").iterdir()}
    assert modes and all(m == 0o644 for m in modes.values()), modes
