"""The engine's Qwen3.5-class hybrid against transformers' Qwen3_5ForCausalLM, both in float32 on CPU.

Random tiny configs written by transformers itself (every weight random, dk != dv, grouped value
heads, 25 % RoPE) and the trained shared model: logits at every prompt position (the engine's
chunked prefill, so chunk boundaries carry the linear-attention state), and greedy decoding of a
batch of prompts of different lengths (the recurrent decode path) against transformers' generate.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import MIXED_PROMPTS, WORKLOADS, make_llm
from engine import SamplingParams
from tests.support.hybrid import build_random_hybrid, require_shared_hybrid
from tests.engine.models.test_qwen3_vs_transformers import hf_greedy, hf_logits, per_position_rel_err, random_prompts

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

REL_TOL = 1e-4

RANDOM_CONFIGS = {
    "base": {},
    # conv width 3, three value heads per key head, tied embeddings, a full layer first, 50 % RoPE
    "variant": dict(linear_conv_kernel_dim=3, linear_num_key_heads=1, linear_num_value_heads=3,
                    linear_key_head_dim=24, linear_value_head_dim=16, tie_word_embeddings=True,
                    layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}),
}


@pytest.fixture(scope="module", params=sorted(RANDOM_CONFIGS))
def random_pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"hybrid-{request.param}")
    hf = build_random_hybrid(path, seed=1, **RANDOM_CONFIGS[request.param])
    # chunk 32: prompts longer than that cross chunk boundaries inside the engine's prefill
    return make_llm(str(path), kv_capacity=4096, prefill_chunk=32), hf


def test_random_config_logits_match_at_every_position(random_pair):
    llm, hf = random_pair
    worst_abs, worst_rel = 0.0, 0.0
    for ids in random_prompts(hf.config.vocab_size, [1, 5, 16, 17, 33, 100, 250], seed=2):
        ours, ref = llm.prompt_logits(ids), hf_logits(hf, ids)
        assert ours.shape == ref.shape == (len(ids), hf.config.vocab_size)
        err = per_position_rel_err(ours, ref)
        assert bool((err <= REL_TOL).all()), f"P={len(ids)}: position {int(err.argmax())} err {float(err.max()):.2e}"
        worst_rel, worst_abs = max(worst_rel, float(err.max())), max(worst_abs, float((ours - ref).abs().max()))
    print(f"\nrandom hybrid: max abs logit error {worst_abs:.2e}, max relative {worst_rel:.2e}")


def test_random_config_batched_greedy_equals_transformers(random_pair):
    llm, hf = random_pair
    prompts = random_prompts(hf.config.vocab_size, [3, 20, 47, 64, 90], seed=3)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, ids, 16), f"P={len(ids)}"


@pytest.fixture(scope="module")
def shared_pair():
    from transformers import Qwen3_5ForCausalLM
    path = require_shared_hybrid()
    hf = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return make_llm(path, prefill_chunk=64), hf


def test_shared_model_logits_match_at_every_position(shared_pair):
    llm, hf = shared_pair
    tok = llm.tokenizer
    texts = [WORKLOADS["json"][0], WORKLOADS["code"][1], "The", WORKLOADS["prose"][3],
             WORKLOADS["enumeration"][0] * 3, "\n".join(WORKLOADS["code"] + WORKLOADS["prose"])]
    prompts = [tok.encode(t) for t in texts]
    assert max(map(len, prompts)) > 128                     # several prefill chunks
    worst_abs, worst_rel = 0.0, 0.0
    for ids in prompts:
        ours, ref = llm.prompt_logits(ids), hf_logits(hf, ids)
        err = per_position_rel_err(ours, ref)
        assert bool((err <= REL_TOL).all()), f"P={len(ids)}: position {int(err.argmax())} err {float(err.max()):.2e}"
        worst_rel, worst_abs = max(worst_rel, float(err.max())), max(worst_abs, float((ours - ref).abs().max()))
    print(f"\nshared hybrid (P = {sorted(map(len, prompts))}): max abs logit error {worst_abs:.2e}, "
          f"max relative {worst_rel:.2e}")


def test_shared_model_batched_greedy_equals_transformers(shared_pair):
    llm, hf = shared_pair
    prompts = [llm.tokenizer.encode(t) for t in MIXED_PROMPTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0))
    for ids, out in zip(prompts, outs):
        ref = hf_greedy(hf, ids, 24)
        # transformers stops at the checkpoint's EOS (id 0) whatever generate is told; the engine ignores it
        assert len(ref) == 24 or ref[-1] == 0
        assert out.token_ids[:len(ref)] == ref, llm.tokenizer.decode(ids)
