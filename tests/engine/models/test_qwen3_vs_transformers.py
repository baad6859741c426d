"""The engine's Qwen3 against Hugging Face transformers' Qwen3ForCausalLM, both in float32.

Two checkpoints: a random tiny config written by transformers itself (untied lm_head, RoPE theta
10000, every norm weight random) and the trained shared model (tied, bf16 weights read as float32).
Logits are compared at every prompt position (relative L2 error per position <= 1e-4), and greedy
decoding of a batch of prompts of different lengths, generated together by the engine, must equal
transformers' greedy `generate` of each prompt alone.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import MIXED_PROMPTS, WORKLOADS, make_llm
from engine import SamplingParams

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

REL_TOL = 1e-4


def per_position_rel_err(engine_logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """[P] relative L2 error of each position's logits."""
    return (engine_logits - ref_logits).norm(dim=-1) / ref_logits.norm(dim=-1)


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy generate of exactly n tokens (EOS does not stop it, as ignore_eos)."""
    from transformers import GenerationConfig
    cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=0, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)
    return out[0, len(ids):].tolist()


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


# -- random tiny config written by transformers ------------------------------------------------------

@pytest.fixture(scope="module")
def random_llm(random_hf_model):
    path, _ = random_hf_model
    return make_llm(str(path), kv_capacity=4096)


def test_random_config_is_read_as_written(random_llm, random_hf_model):
    _, hf = random_hf_model
    cfg = random_llm.engine.model_config
    assert cfg.rope_theta == 10_000.0 and not cfg.tie_word_embeddings
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        hf.config.num_hidden_layers, hf.config.num_attention_heads, hf.config.num_key_value_heads,
        hf.config.head_dim)


def test_random_config_logits_match_at_every_position(random_llm, random_hf_model):
    _, hf = random_hf_model
    prompts = random_prompts(hf.config.vocab_size, [1, 5, 16, 17, 33, 100, 250])
    worst = 0.0
    for ids in prompts:
        ours = random_llm.prompt_logits(ids)
        ref = hf_logits(hf, ids)
        assert ours.shape == ref.shape == (len(ids), hf.config.vocab_size)
        err = per_position_rel_err(ours, ref)
        assert bool((err <= REL_TOL).all()), f"P={len(ids)}: worst position {int(err.argmax())} err {float(err.max()):.2e}"
        worst = max(worst, float(err.max()))
    print(f"\nrandom config: max relative logit error over {len(prompts)} prompts = {worst:.2e}")


def test_random_config_batched_greedy_equals_transformers(random_llm, random_hf_model):
    _, hf = random_hf_model
    prompts = random_prompts(hf.config.vocab_size, [3, 20, 47, 64, 90], seed=1)
    n = 16
    outs = random_llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, ids, n), f"P={len(ids)}"
        assert out.finish_reason == "length"


# -- the trained shared model ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_shared(shared_model):
    from transformers import Qwen3ForCausalLM
    return Qwen3ForCausalLM.from_pretrained(shared_model, dtype=torch.float32).eval()


def test_shared_model_logits_match_at_every_position(llm_k0, hf_shared):
    tok = llm_k0.tokenizer
    texts = [WORKLOADS["json"][0], WORKLOADS["code"][1], "The", WORKLOADS["prose"][3],
             WORKLOADS["enumeration"][0] * 3, "\n".join(WORKLOADS["code"] + WORKLOADS["prose"])]
    prompts = [tok.encode(t) for t in texts]
    assert len({len(p) for p in prompts}) == len(prompts) and max(map(len, prompts)) > 100
    worst = 0.0
    for ids in prompts:
        ours = llm_k0.prompt_logits(ids)
        ref = hf_logits(hf_shared, ids)
        assert ours.shape == ref.shape
        err = per_position_rel_err(ours, ref)
        assert bool((err <= REL_TOL).all()), f"P={len(ids)}: worst position {int(err.argmax())} err {float(err.max()):.2e}"
        worst = max(worst, float(err.max()))
    print(f"\nshared model: max relative logit error over {len(prompts)} prompts "
          f"(P = {sorted(map(len, prompts))}) = {worst:.2e}")


def test_shared_model_batched_greedy_equals_transformers(llm_k0, hf_shared):
    tok = llm_k0.tokenizer
    prompts = [tok.encode(t) for t in MIXED_PROMPTS]
    n = 24
    outs = llm_k0.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf_shared, ids, n), tok.decode(ids)
