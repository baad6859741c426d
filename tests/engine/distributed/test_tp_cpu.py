"""Tensor parallelism on the CPU: two ranks in one process on the local communicator (each rank in
its own thread) must compute what one rank computes. The same layers and executor run with the
CUDA communicators on two GPUs (tests/engine/test_engine_gpu.py, tests/engine/distributed/test_communicators_multi_gpu.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.conftest import assert_kv_idle, make_llm
from tests.support.graph_standin import StandInRounds
from engine import SamplingParams
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.distributed.tp_group import SINGLE_RANK, LocalCommunicator

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
    greedy = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
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


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("draft_tokens", [0, 2])
def test_memory_plan_counts_the_bytes_each_rank_holds(tp, draft_tokens):
    """The plan's weight bytes are what every rank's loaded shard holds: parameters (norms and the
    MTP fc whole on each rank, the vocabulary in ceil(V / tp) rows) and the RoPE table."""
    llm = make_llm(None, tensor_parallel_size=tp, draft_tokens=draft_tokens, kv_capacity=256)
    for runner in llm.engine.executor.runners:
        model = runner.model
        held = (sum(p.numel() * p.element_size() for p in model.parameters())
                + sum(b.numel() * b.element_size() for b in model.buffers()))
        assert held == llm.engine.memory.weights_bytes


@pytest.mark.parametrize("kw, buckets", [
    ({"draft_tokens": 3, "draft_vocab": 3000, "max_batch": 4}, [1, 2]),   # rounds of 3-4 run eagerly
    ({"draft_tokens": 2, "max_batch": 3}, [1, 2, 3]),
    ({"draft_tokens": 0, "max_batch": 2}, [1, 2]),
])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tp2_lockstep_rounds_equal_tp1(shared_model, kw, buckets, async_scheduling):
    """The engine thread packs once, uploads rank 0's staging to every rank, launches every rank and
    reads rank 0 (one round later with async scheduling, the next round's rows carried on each rank
    from its own last tokens): same tokens as TP=1, greedy and sampled, with chunked prefills between."""
    prompts = [s * 4 for s in ("def f(x):\n    return", "Hello world, this is", "Line 1: the quick brown fox",
                               "import numpy as np\n", "The capital of", "a b c d e f g")]
    greedy = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
    sampled = [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.8, top_k=50, seed=s, ignore_eos=True)
               for s in range(len(prompts))]
    # logit options and logprobs: the option slots and the logprob readback take the same lockstep path
    options = [SamplingParams(max_tokens=16, temperature=0.9 * (s % 2), seed=s, ignore_eos=True, logprobs=2,
                              repetition_penalty=1.2, frequency_penalty=0.5, logit_bias={7: 1.5}, min_p=0.05)
               for s in range(len(prompts))]
    one = make_llm(shared_model, prefill_chunk=16, **kw)
    two = make_llm(shared_model, prefill_chunk=16, tensor_parallel_size=2, async_scheduling=async_scheduling, **kw)
    assert two.engine.async_scheduling is async_scheduling
    ex = two.engine.executor
    for runner in ex.runners:
        runner.graphs = StandInRounds(ex, runner, buckets)
    carried = []
    launch = ex.launch
    ex.launch = lambda out: carried.append(any(w.carry_row >= 0 for w in out.decode)) or launch(out)
    for params in (greedy, sampled, options):
        got, want = two.generate(prompts, params), one.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        if params is options:
            for a, b in zip(got, want):
                assert [list(p) for p in a.outputs[0].logprobs] == [list(p) for p in b.outputs[0].logprobs]
    assert ex.runners[0].graphs.launches > 0 and ex.runners[1].graphs.launches == ex.runners[0].graphs.launches
    assert (sum(carried) >= 5) is async_scheduling, carried       # rounds planned ahead, each rank carrying
    assert ex.runners[0].round_setup.pool_rows == ex.runners[1].round_setup.pool_rows  # (the last row goes at the next step)
    assert_kv_idle(two.engine)


def test_a_rank_that_raises_leaves_no_stale_result(tp_pair):
    _, two = tp_pair
    ex = two.engine.executor
    for failing in (0, 1):
        with pytest.raises(ZeroDivisionError):
            ex.run_all(lambda r, f=failing: 1 / 0 if r.tp.rank == f else r.tp.rank)
        assert ex.run_all(lambda r: r.tp.rank) == [0, 1]
