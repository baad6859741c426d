"""Chunked prefill equals one-pass prefill (float32): logits at every prompt position, for chunk sizes
that divide the prompt and that do not, with chunks ending inside and on KV blocks (block_size 16);
and with MTP speculation, the MTP entries written chunk by chunk give the same drafts (identical
acceptance counts) and the same outputs."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import WORKLOADS, make_llm
from engine import SamplingParams

CHUNKS = [16, 17, 48, 100]
PROMPT_LEN = 130
MAX_ABS = 1e-4


@pytest.fixture(scope="module")
def prompts(shared_model):
    llm = make_llm(shared_model)
    text = "\n".join(WORKLOADS["code"] + WORKLOADS["json"])
    ids = llm.tokenizer.encode(text)[:PROMPT_LEN]
    assert len(ids) == PROMPT_LEN
    gen = torch.Generator().manual_seed(3)
    noise = torch.randint(1, llm.engine.model_config.vocab_size, (PROMPT_LEN,), generator=gen).tolist()
    return {"text": ids, "random_ids": noise, "one_block": ids[:16], "short": ids[:5]}


@pytest.fixture(scope="module")
def one_pass(shared_model, prompts):
    llm = make_llm(shared_model, prefill_chunk=2048, prefix_reuse=False)
    return {name: llm.prompt_logits(ids) for name, ids in prompts.items()}


@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunked_logits_equal_one_pass(shared_model, prompts, one_pass, chunk):
    llm = make_llm(shared_model, prefill_chunk=chunk, prefix_reuse=False)
    diffs = {}
    for name, ids in prompts.items():
        logits = llm.prompt_logits(ids)
        assert logits.shape == one_pass[name].shape == (len(ids), llm.engine.model_config.vocab_size)
        diffs[name] = float((logits - one_pass[name]).abs().max())
    print(f"\nchunk {chunk}: max |chunked - one-pass| logit difference per prompt: "
          + ", ".join(f"{n} {d:.2e}" for n, d in diffs.items()))
    assert max(diffs.values()) <= MAX_ABS, diffs


def test_chunk_count_is_what_the_lane_promises(shared_model, prompts):
    """A 130-token prompt with chunk 17 takes ceil(130/17) = 8 prefill steps, the last of which samples."""
    llm = make_llm(shared_model, prefill_chunk=17, prefix_reuse=False)
    core = llm.engine
    req = core.add_request(prompts["text"], SamplingParams(max_tokens=1, temperature=0.0))
    steps = 0
    while not req.finished:
        sched = core.scheduler
        core.step()
        steps += 1
        if not req.finished:
            assert req.num_computed_tokens == min(17 * steps, PROMPT_LEN) and sched.lane.requests == [req]
    assert steps == -(-PROMPT_LEN // 17)
    assert req.computed_prefill_tokens == PROMPT_LEN


@pytest.mark.parametrize("chunk", [16, 17])
def test_chunked_prefill_with_mtp_gives_identical_drafts(shared_model, prompts, chunk):
    """The MTP layer's KV is written chunk by chunk too (the position at a chunk's end needs the next
    chunk's first token): any error there changes the drafts and thus the acceptance counts."""
    params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0)
    batch = [prompts["text"], prompts["random_ids"], prompts["text"][:70]]
    ref = make_llm(shared_model, draft_tokens=3, prefill_chunk=2048, prefix_reuse=False).generate(batch, params)
    got = make_llm(shared_model, draft_tokens=3, prefill_chunk=chunk, prefix_reuse=False).generate(batch, params)
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids
        assert g.stats.speculative == r.stats.speculative
    assert sum(r.stats.speculative.accepted for r in ref) > 0


def test_prompt_logits_covers_every_position_with_a_cached_prefix(shared_model, prompts):
    """With prefix reuse on, scoring the same prompt twice still returns logits for all P positions
    (the second prefill would otherwise start after the cached blocks)."""
    llm = make_llm(shared_model, prefill_chunk=48)
    first = llm.prompt_logits(prompts["text"])
    second = llm.prompt_logits(prompts["text"])
    assert first.shape == second.shape == (PROMPT_LEN, llm.engine.model_config.vocab_size)
    assert float((first - second).abs().max()) <= MAX_ABS
