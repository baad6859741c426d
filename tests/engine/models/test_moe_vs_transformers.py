"""The engine's mixture-of-experts Qwen models against transformers, both in float32 on CPU.

One tiny random checkpoint per architecture, written by transformers itself (tests/support/moe.py):
qwen3_moe with a dense layer among sparse ones and no top-k renormalisation, qwen3_next (grouped
DeltaNet projections, a dense layer, the gated shared expert) and qwen3_5_moe. The engine prefills in
chunks of 16 tokens, so prompts cross chunk boundaries (and carry linear-attention state across them):

- logits at every prompt position (relative error per position <= 1e-4);
- greedy continuations of a batch of prompts of different lengths equal transformers' generate;
- the router's choices equal transformers' on every token of every sparse layer (the top-k sets from
  transformers' own router logits), with the near-ties among them counted and printed.
"""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.layers.moe import SparseMoeBlock
from tests.conftest import make_llm
from tests.engine.models.test_qwen3_vs_transformers import hf_greedy, hf_logits, per_position_rel_err, random_prompts
from tests.support.moe import ARCHS, build_random_moe

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

REL_TOL = 1e-4
NEAR_TIE = 1e-4          # a gap between the k-th and (k+1)-th routing probability below this is reported


@pytest.fixture(scope="module", params=sorted(ARCHS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf, _ = build_random_moe(path, request.param, seed=1, with_mtp=False)
    return request.param, make_llm(str(path), kv_capacity=4096, prefill_chunk=16), hf


def test_config_is_read_as_written(pair):
    arch, llm, hf = pair
    cfg = llm.engine.model_config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.norm_topk_prob == (arch != "qwen3_moe")
    assert cfg.shared_expert_intermediate_size == (0 if arch == "qwen3_moe" else 48)
    sparse = [i for i in range(cfg.num_hidden_layers) if cfg.layer_is_moe(i)]
    assert sparse == {"qwen3_moe": [0, 2], "qwen3_next": [1, 2, 3], "qwen3_5_moe": [0, 1, 2, 3]}[arch]
    layers = llm.engine.executor.driver.model.model.layers
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [cfg.layer_is_moe(i) for i in range(len(layers))]


def test_logits_match_at_every_position(pair):
    arch, llm, hf = pair
    worst = 0.0
    for ids in random_prompts(hf.config.vocab_size, [1, 5, 16, 17, 40, 100], seed=2):
        ours, ref = llm.prompt_logits(ids), hf_logits(hf, ids)
        assert ours.shape == ref.shape == (len(ids), hf.config.vocab_size)
        err = per_position_rel_err(ours, ref)
        assert bool((err <= REL_TOL).all()), f"{arch} P={len(ids)}: position {int(err.argmax())} err {float(err.max()):.2e}"
        worst = max(worst, float(err.max()))
    print(f"\n{arch}: max relative logit error {worst:.2e}")


def test_batched_greedy_over_chunked_prefill_equals_transformers(pair):
    arch, llm, hf = pair
    prompts = random_prompts(hf.config.vocab_size, [3, 20, 47, 64], seed=3)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, ids, 16), f"{arch} P={len(ids)}"


def test_router_choices_equal_transformers_on_every_token(pair, monkeypatch):
    arch, llm, hf = pair
    calls: dict[int, list[torch.Tensor]] = {}
    real = SparseMoeBlock.route

    def recording(self, logits):
        ids, weights = real(self, logits)
        calls.setdefault(id(self), []).append(ids)
        return ids, weights
    monkeypatch.setattr(SparseMoeBlock, "route", recording)
    blocks = [layer.mlp for layer in llm.engine.executor.driver.model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    k = hf.config.num_experts_per_tok
    tokens = near_ties = 0
    smallest_gap = float("inf")
    for ids in random_prompts(hf.config.vocab_size, [33, 70], seed=4):
        calls.clear()
        llm.prompt_logits(ids)
        with torch.no_grad():
            router_logits = hf(torch.tensor([ids]), output_router_logits=True).router_logits
        assert len(router_logits) == len(blocks)
        for block, logits in zip(blocks, router_logits):
            ours = torch.cat(calls[id(block)]).long()                         # the prefill's chunks, in order
            probs = torch.softmax(logits.float(), -1)
            top = probs.topk(k + 1, dim=-1)
            gap = top.values[:, k - 1] - top.values[:, k]
            smallest_gap = min(smallest_gap, float(gap.min()))
            near_ties += int((gap < NEAR_TIE).sum())
            tokens += len(ids)
            assert torch.equal(ours.sort(-1).values, top.indices[:, :k].sort(-1).values), arch
    print(f"\n{arch}: routing equal on {tokens} (token, layer) rows; smallest gap between the k-th and the next "
          f"expert {smallest_gap:.2e}; {near_ties} rows with a gap below {NEAR_TIE:g}")
