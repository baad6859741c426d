"""The serving paths of the dense models, on MoE models (tiny random checkpoints, tests/support/moe.py):

- prefix reuse: a shared prefix is computed once -- KV blocks on Qwen3-MoE, KV blocks up to a linear-attention
  state snapshot on the hybrids (Qwen3-Next, Qwen3.5-MoE) -- and the requests that reuse it continue exactly as
  a fresh engine without reuse does, with and without MTP drafts;
- async scheduling (round N+1 planned while N runs) gives the synchronous engine's tokens;
- every KV block and state slot comes back.
"""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.conftest import assert_kv_idle, make_llm
from tests.engine.models.test_qwen3_vs_transformers import random_prompts
from tests.support.moe import build_random_moe

pytest.importorskip("transformers")

PARAMS = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
PREFIX = random_prompts(384, [75], seed=12)[0]
SUFFIXES = random_prompts(384, [3, 9, 20], seed=13)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next", "qwen3_5_moe"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"serve-{request.param}")
    build_random_moe(path, request.param, seed=10, echo_mtp=1.2)
    fresh = make_llm(str(path), prefix_reuse=False, prefill_chunk=16)
    want = [o.token_ids for o in fresh.generate([PREFIX + s for s in SUFFIXES], PARAMS)]
    return request.param, str(path), want


@pytest.mark.parametrize("k", [0, 3])
def test_a_shared_prefix_is_computed_once(model, k):
    arch, path, want = model
    if k and arch == "qwen3_moe":
        pytest.skip("Qwen3-MoE checkpoints have no MTP layer")
    llm = make_llm(path, prefill_chunk=16, draft_tokens=k)
    bs = llm.engine.config.block_size
    cached = []
    for suffix, tokens in zip(SUFFIXES, want):
        out = llm.generate([PREFIX + suffix], PARAMS)[0]
        assert out.token_ids == tokens
        cached.append(out.stats.usage.cached_tokens)
    assert cached[0] == 0 and all(c >= 64 and c % bs == 0 for c in cached[1:]), cached
    assert_kv_idle(llm.engine)


def test_async_scheduling_equals_synchronous(model):
    arch, path, _ = model
    k = 0 if arch == "qwen3_moe" else 3
    prompts = random_prompts(384, [6, 30, 51], seed=14)
    sync = make_llm(path, async_scheduling=False, draft_tokens=k, prefill_chunk=16)
    overlapped = make_llm(path, draft_tokens=k, prefill_chunk=16)
    assert overlapped.engine.async_scheduling and not sync.engine.async_scheduling
    want = [o.token_ids for o in sync.generate(prompts, PARAMS)]
    assert [o.token_ids for o in overlapped.generate(prompts, PARAMS)] == want
    assert_kv_idle(overlapped.engine)
