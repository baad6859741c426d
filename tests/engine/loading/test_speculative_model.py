"""The MTP head beside a quantized base (`--speculative-model DIR` / `--speculative-config`): the base has no
mtp.* tensors (ModelOpt, gptqmodel on Qwen3 and AutoAWQ drop them), the head comes from another checkpoint,
bf16 or quantized in its own layout. Greedy output with k=3 equals k=0 (TP=1 and TP=2) with drafts accepted,
and a head that does not fit the base is refused naming the fields."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.conftest import assert_kv_idle, make_llm
from tests.support import quant_layouts as ql
from engine import InvalidArgumentError, ModelLoadError, SamplingParams
from engine.config import EngineConfig
from engine.quant.quantize import quantize_checkpoint

PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return", "Line 1: the quick brown fox jumps"]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)


def drop_mtp(d: Path) -> Path:
    """Remove every mtp.* tensor of checkpoint `d` (as ModelOpt's export does)."""
    index = d / "model.safetensors.index.json"
    for file in d.glob("*.safetensors"):
        t = load_file(str(file))
        save_file({n: x for n, x in t.items() if not n.startswith("mtp.")}, str(file))
    if index.exists():
        doc = json.loads(index.read_text())
        doc["weight_map"] = {n: f for n, f in doc["weight_map"].items() if not n.startswith("mtp.")}
        index.write_text(json.dumps(doc))
    return d


@pytest.fixture(scope="module")
def dropped(shared_model, tmp_path_factory):
    """(an FP8 copy of the shared model without its MTP head, an NVFP4 copy with its MTP layer quantized)."""
    root = tmp_path_factory.mktemp("spec")
    quantize_checkpoint(Path(shared_model), root / "fp8", "fp8")
    quantize_checkpoint(Path(shared_model), root / "nvfp4", "nvfp4")
    return drop_mtp(root / "fp8"), root / "nvfp4"


def _tokens(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("head", ["bf16", "nvfp4"])
def test_a_head_from_another_checkpoint_drafts_losslessly(shared_model, dropped, head):
    base, nvfp4 = dropped
    source = shared_model if head == "bf16" else str(nvfp4)
    alone = make_llm(str(base), draft_tokens=3)
    assert alone.engine.draft_tokens == 0                   # no head: speculation off
    want = _tokens(make_llm(str(base)))
    spec = make_llm(str(base), draft_tokens=3, speculative_model=source)
    model = spec.engine.executor.driver.model
    assert model.model.layers[0].mlp.down_proj.quant == "fp8"
    assert model.mtp.fc.quant == (None if head == "bf16" else "nvfp4")        # the head keeps its own layout
    outs = spec.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == want
    assert sum(o.stats.speculative.accepted for o in outs) > 0
    assert_kv_idle(spec.engine)


def test_tp2_with_a_head_from_another_checkpoint(shared_model, dropped):
    base, _ = dropped
    want = _tokens(make_llm(str(base)))
    two = make_llm(str(base), tensor_parallel_size=2, draft_tokens=3, speculative_model=shared_model)
    assert _tokens(two) == want


@pytest.mark.parametrize("base, head", [("modelopt_fp8/qwen3_5", "gptq_int4_sym/qwen3_5"),
                                        ("gptq_int4_asym_descact_g32/qwen3", "ct_w4a16_sym/qwen3")])
def test_producer_checkpoints_take_a_head_from_another_producer(base, head):
    """ModelOpt and gptqmodel (Qwen3) drop mtp.*; gptqmodel (Qwen3.5) and llmcompressor keep it in bf16."""
    base_dir, head_dir = ql.FIXTURES / base, ql.FIXTURES / head
    assert not any(n.startswith("mtp.") for n in ql.tensors(base_dir))
    want = _tokens(make_llm(str(base_dir), kv_capacity=1024))
    for tp in (1, 2):
        spec = make_llm(str(base_dir), kv_capacity=1024, draft_tokens=3, speculative_model=str(head_dir),
                        tensor_parallel_size=tp)
        assert _tokens(spec) == want


def test_speculative_config_as_vllm_spells_it(shared_model, dropped):
    base, _ = dropped
    spec = {"model": shared_model, "num_speculative_tokens": 2, "method": "mtp"}
    cfg = EngineConfig(model=str(base), device="cpu", speculative_config=json.dumps(spec))
    assert (cfg.speculative_model, cfg.draft_tokens) == (shared_model, 2)
    assert make_llm(str(base), speculative_config=spec).engine.draft_tokens == 2


@pytest.mark.parametrize("spec, field", [
    ({"model": "x", "num_speculative_tokens": 2, "method": "eagle"}, "speculative_config.method"),
    ({"model": "x", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
     "speculative_config.draft_tensor_parallel_size"),
    ("{not json", "speculative_config"),
    ({"model": "x"}, "speculative_model"),                  # no k: nothing would draft
])
def test_bad_speculative_config_is_refused_by_field(spec, field):
    with pytest.raises(InvalidArgumentError) as e:
        EngineConfig(device="cpu", speculative_config=spec if isinstance(spec, str) else json.dumps(spec))
    assert e.value.field == field


def test_a_head_that_does_not_fit_is_refused_naming_the_fields(shared_model, tmp_path):
    base = ql.FIXTURES / "modelopt_fp8/qwen3"
    with pytest.raises(ModelLoadError) as e:
        make_llm(str(base), kv_capacity=1024, draft_tokens=3, speculative_model=shared_model)
    assert "its MTP head does not fit the base model: hidden_size 384 (the base model's: 128)" in str(e.value)
    shutil.copytree(base, tmp_path / "no-head")
    with pytest.raises(ModelLoadError, match="has no mtp.. tensors"):
        make_llm(str(base), kv_capacity=1024, draft_tokens=3, speculative_model=str(tmp_path / "no-head"))


def test_the_cli_flags_reach_the_engine_config():
    import argparse

    from ninfer.cli import flags
    p = argparse.ArgumentParser()
    flags.add_engine_args(p)
    a = flags.engine_config_from_args(p.parse_args(["--device", "cpu", "--speculative-model", "/m", "--draft-tokens", "3"]))
    assert (a.speculative_model, a.draft_tokens) == ("/m", 3)
    b = flags.engine_config_from_args(p.parse_args(
        ["--device", "cpu", "--speculative-config", '{"model": "/m", "num_speculative_tokens": 4, "method": "mtp"}']))
    assert (b.speculative_model, b.draft_tokens) == ("/m", 4)
