"""Prefix reuse on the hybrid: a cached prefix is used up to a linear-attention state snapshot at a
block boundary, never past it (engine/cache/state_snapshots.py).

- A shared system prompt is computed once: the second request skips it up to the last snapshot,
  `cached_tokens` is exactly what it skipped (a multiple of the block size), and its tokens equal
  those of a fresh engine without reuse -- greedy, with and without MTP.
- A repeated prompt reuses everything up to its last block boundary.
- Where no snapshot exists (evicted from a one-slot pool), the request recomputes from the start.
- Preemption with reuse on restores from snapshots or recomputes: solo tokens (tests/engine/models/test_hybrid_state.py).
"""

from __future__ import annotations

import pytest

from tests.conftest import WORKLOADS, assert_kv_idle, make_llm
from engine import SamplingParams
from tests.support.hybrid import require_shared_hybrid

SYSTEM = "\n".join(WORKLOADS["code"]) + "\n"
QUESTIONS = ["He who laughs last", WORKLOADS["json"][2], WORKLOADS["prose"][1]]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)


@pytest.fixture(scope="module")
def hybrid():
    return require_shared_hybrid()


@pytest.fixture(scope="module")
def fresh(hybrid):
    llm = make_llm(hybrid, prefix_reuse=False)
    return {q: llm.generate([SYSTEM + q], PARAMS)[0].token_ids for q in QUESTIONS}


def snapshot_points(p: int, chunk: int, bs: int) -> set[int]:
    """Where a prompt of p tokens leaves snapshots: chunk ends on block boundaries and its last boundary."""
    return {m for m in range(chunk, p, chunk) if m % bs == 0} | {(p - 1) // bs * bs} - {0}


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("k", [0, 3])
def test_shared_system_prompt_is_computed_once(hybrid, fresh, k):
    llm = make_llm(hybrid, draft_tokens=k, prefill_chunk=64)
    bs = llm.engine.config.block_size
    seen: list[list[int]] = []
    for q in QUESTIONS:
        ids = llm.tokenizer.encode(SYSTEM + q)
        out = llm.generate([ids], PARAMS)[0]
        assert out.token_ids == fresh[q], q
        s = out.stats
        # the longest snapshot an earlier prompt left inside what this one shares with it (the block's
        # key covers the token after it too, hence b < shared)
        want = max((b for prev in seen for b in snapshot_points(len(prev), 64, bs) if b < common(prev, ids)),
                   default=0)
        assert s.usage.cached_tokens == want and want % bs == 0
        assert s.usage.cached_tokens + s.usage.computed_prefill_tokens == s.usage.prompt_tokens
        seen.append(ids)
    assert want >= 128                                  # the shared system prompt was skipped
    assert_kv_idle(llm.engine)


def test_repeated_prompt_reuses_up_to_its_last_block(hybrid, fresh):
    llm = make_llm(hybrid)
    prompt = SYSTEM + QUESTIONS[0]
    p = len(llm.tokenizer.encode(prompt))
    first, again = (llm.generate([prompt], PARAMS)[0] for _ in range(2))
    assert first.stats.usage.cached_tokens == 0
    assert again.stats.usage.cached_tokens == (p - 1) // 16 * 16 > 0
    assert first.token_ids == again.token_ids == fresh[QUESTIONS[0]]


def test_without_a_snapshot_the_prefix_is_recomputed(hybrid, fresh):
    llm = make_llm(hybrid, state_snapshots=1, prefill_chunk=4096)
    # each prompt's one snapshot (its last block boundary) lies past the part the two share
    a, b = SYSTEM + WORKLOADS["json"][0], SYSTEM + QUESTIONS[1]
    first_a = llm.generate([a], PARAMS)[0]
    out_b = llm.generate([b], PARAMS)[0]           # its KV prefix is cached, but no snapshot inside it
    assert out_b.stats.usage.cached_tokens == 0 and out_b.token_ids == fresh[QUESTIONS[1]]
    again_a = llm.generate([a], PARAMS)[0]         # b's snapshot evicted a's: recompute again
    assert again_a.stats.usage.cached_tokens == 0 and again_a.token_ids == first_a.token_ids
    assert llm.engine.snapshots.num_bound == 1
    once_more = llm.generate([a], PARAMS)[0]       # and now a's own snapshot is back
    assert once_more.stats.usage.cached_tokens > 0 and once_more.token_ids == first_a.token_ids
    assert_kv_idle(llm.engine)


def test_snapshot_pool_is_lru_and_reserves_before_binding():
    from engine.cache.state_snapshots import StateSnapshots
    snaps = StateSnapshots(first_slot=4, num_slots=2)
    s1, s2 = snaps.reserve(), snaps.reserve()
    assert {s1, s2} == {4, 5}
    snaps.bind(s1, b"a")
    snaps.bind(s2, b"b")
    assert snaps.usable_prefix([b"x", b"a", b"y"]) == (2, s1)      # the longest leading run with one
    assert snaps.usable_prefix([b"y"]) == (0, -1)
    s3 = snaps.reserve()                                            # evicts b (a was used more recently)
    assert s3 == s2 and snaps.usable_prefix([b"b"]) == (0, -1)
    snaps.bind(s3, None)                                            # a chunk whose block never registered
    assert snaps.num_bound == 1 and snaps.reserve() == s3


@pytest.mark.parametrize("k", [0, 3])
def test_questions_sent_together_pack_and_reuse_the_system_prompt(hybrid, fresh, k):
    """All questions at once: the first prompt's chunk does not take the others (they would compute the
    same blocks); they wait for its snapshots, then pack together behind it. Tokens equal the fresh
    engine's; each reuse ends at a snapshot; the system prompt is not computed three times."""
    llm = make_llm(hybrid, draft_tokens=k, prefill_chunk=64)
    bs = llm.engine.config.block_size
    outs = llm.generate([SYSTEM + q for q in QUESTIONS], PARAMS)
    assert [o.token_ids for o in outs] == [fresh[q] for q in QUESTIONS]
    usage = [o.stats.usage for o in outs]
    for u in usage:
        assert u.cached_tokens % bs == 0 and u.cached_tokens + u.computed_prefill_tokens == u.prompt_tokens
    shared = len(llm.tokenizer.encode(SYSTEM))
    assert usage[0].cached_tokens == 0
    assert all(u.cached_tokens >= shared - 2 * 64 for u in usage[1:]), [u.cached_tokens for u in usage]
    assert_kv_idle(llm.engine)
