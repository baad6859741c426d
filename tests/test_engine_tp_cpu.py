"""Tensor parallelism on the CPU: two ranks in one process on the local communicator (each rank in
its own thread) must compute what one rank computes. The same layers and executor run with the
CUDA communicators on two GPUs (tests/test_engine_gpu.py, tests/test_parallel_gpu.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import assert_kv_idle, make_llm
from engine import SamplingParams
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.parallel import SINGLE_RANK, LocalCommunicator

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    '{"order_id": "ORD-381901", "item": "printer", "quantity": 8}, {"order_id": "ORD-381902",',
    "Line 1: the quick brown fox jumps over the lazy dog.\nLine 2:",
]


def on_ranks(world: int, fn) -> list:
    """fn(group) on every rank of a LocalCommunicator, one thread each; results in rank order."""
    groups, out, errors = LocalCommunicator(world).groups(), [None] * world, []

    def body(r):
        try:
            out[r] = fn(groups[r])
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            groups[r].comm._barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("world, vocab", [(2, 1000), (2, 1001), (3, 1000)])
@pytest.mark.parametrize("num_rows", [None, 300, 500, 501, 999, 5000])
def test_vocab_parallel_lm_head_and_embedding_equal_one_rank(world, vocab, num_rows):
    gen = torch.Generator().manual_seed(vocab + world)
    full = torch.randn(vocab, 64, generator=gen)
    hidden = torch.randn(5, 64, generator=gen)
    ids = torch.tensor([0, 1, vocab // 2, vocab // 2 + 1, vocab - 1, 7])

    def build(cls, tp):
        layer = cls(vocab, 64, tp)
        layer.weight_loader(layer.weight, full)
        return layer

    head1, emb1 = build(ParallelLMHead, SINGLE_RANK), build(VocabParallelEmbedding, SINGLE_RANK)
    want_logits, want_rows = head1(hidden, num_rows), emb1(ids)
    assert want_logits.shape == (5, min(num_rows or vocab, vocab))

    def rank(group):
        head, emb = build(ParallelLMHead, group), build(VocabParallelEmbedding, group)
        assert head.weight.shape[0] == -(-vocab // world)          # 1/world of the rows each
        return head(hidden, num_rows), emb(ids)

    for logits, rows in on_ranks(world, rank):
        assert torch.equal(rows, want_rows)                          # one non-zero term per row: exact
        assert logits.shape == want_logits.shape
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)  # BLAS blocks differ


@pytest.fixture(scope="module")
def tp_pair(shared_model):
    return make_llm(shared_model), make_llm(shared_model, tensor_parallel_size=2)


def test_tp2_prompt_logits_equal_tp1(tp_pair):
    one, two = tp_pair
    assert two.engine.executor.num_ranks == 2
    for prompt in PROMPTS:
        a, b = one.prompt_logits(prompt), two.prompt_logits(prompt)
        assert a.shape == b.shape
        rel = float((a - b).abs().max() / a.abs().max())
        assert rel < 1e-5, f"TP=2 logits differ from TP=1 by {rel:.2e} (relative to the largest logit)"


@pytest.mark.parametrize("draft_tokens", [0, 3])
def test_tp2_greedy_equals_tp1(shared_model, tp_pair, draft_tokens):
    one, _ = tp_pair
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in one.generate(PROMPTS, greedy)]
    two = make_llm(shared_model, tensor_parallel_size=2, draft_tokens=draft_tokens)
    got = [o.token_ids for o in two.generate(PROMPTS, greedy)]
    assert got == want
    assert_kv_idle(two.engine)


def test_tp2_seeded_sampling_equals_tp1(shared_model, tp_pair):
    one, two = tp_pair
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    assert [o.token_ids for o in two.generate(PROMPTS, params)] == [o.token_ids for o in one.generate(PROMPTS, params)]


def test_tp2_shards_the_vocabulary(tp_pair):
    one, two = tp_pair
    full = one.engine.executor.driver.model.lm_head.weight.shape[0]
    for runner in two.engine.executor.runners:
        assert runner.model.lm_head.weight.shape[0] == -(-full // 2)
        assert runner.model.model.embed_tokens.weight.shape[0] == -(-full // 2)
