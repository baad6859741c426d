"""The quality tool on the shared tiny model, cut down for CI (one text and one prompt per kind):
loose floors that a broken format (a swapped nibble, a lost scale) falls far below. The full figures
are tools/quality/quant_quality.py's, committed under bench/results/."""

from __future__ import annotations

import pytest

from tools.quality.quant_quality import markdown, measure
from tools.quality.quant_quality_texts import PROMPTS, TEXTS

FLOORS = {"fp8": 0.95, "nvfp4": 0.85}


@pytest.fixture(scope="module")
def small_run(shared_model, tmp_path_factory):
    texts = {k: v[:1] for k, v in TEXTS.items()}
    prompts = {k: v[:1] for k, v in PROMPTS.items()}
    # nvfp4-search left out here: its scale search is tested in tests/engine/quant/test_formats.py, and a third
    # quantized model cost CI 40 s
    return measure(shared_model, formats=("fp8", "nvfp4"), texts=texts, prompts=prompts, max_tokens=16,
                   workdir=str(tmp_path_factory.mktemp("quality")))


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_teacher_forced_agreement_clears_a_loose_floor(small_run, fmt):
    tf = small_run["formats"][fmt]["teacher_forced"]
    assert set(tf) == {"prose", "code", "json", "enumeration", "overall"}
    assert tf["overall"]["agreement"] >= FLOORS[fmt], tf
    assert small_run["formats"][fmt]["quantized_modules"] == 64       # 8 layers x 7, MTP layer 7, MTP fc


def test_fp8_agrees_more_than_nvfp4(small_run):
    f = small_run["formats"]
    assert f["fp8"]["teacher_forced"]["overall"]["agreement"] >= f["nvfp4"]["teacher_forced"]["overall"]["agreement"]
    assert f["fp8"]["greedy"]["token_agreement"] >= 0.5


def test_mtp_acceptance_is_measured_for_every_model(small_run):
    for acc in [small_run["bf16_acceptance_k3"]] + [e["acceptance_k3"] for e in small_run["formats"].values()]:
        assert len(acc["overall"]) == 3
        assert acc["overall"][0] >= acc["overall"][1] >= acc["overall"][2]   # all-accepted-up-to is monotone
        assert acc["overall"][0] > 0.3
    assert "| fp8 | overall |" in markdown(small_run)


def test_measure_layouts_takes_checkpoints_and_online_methods(shared_model, tmp_path):
    """A producer's checkpoint without its MTP head drafts with the base model's; --quantization methods run too."""
    from pathlib import Path

    from engine.quant.quantize import quantize_checkpoint
    from tests.engine.loading.test_speculative_model import drop_mtp
    from tools.quality.quant_quality import measure_layouts
    quantize_checkpoint(Path(shared_model), tmp_path / "nvfp4", "nvfp4")
    r = measure_layouts(shared_model, {"nvfp4-no-mtp": str(drop_mtp(tmp_path / "nvfp4"))}, ("ptpc_fp8",),
                        texts={"json": TEXTS["json"][:1]}, prompts={"json": PROMPTS["json"][:2]}, max_tokens=16)
    dropped, online = r["formats"]["nvfp4-no-mtp"], r["formats"]["--quantization ptpc_fp8"]
    assert dropped["mtp_head"] == "the bf16 model's (--speculative-model)" and dropped["acceptance_k3"]["overall"][0] > 0.3
    assert online["mtp_head"] == "the checkpoint's own" and online["layout"] == "ptpc_fp8"
    assert online["teacher_forced"]["overall"]["agreement"] >= 0.95
    assert dropped["quantized_modules"] == 56                       # 8 layers x 7; the MTP layer's were dropped
