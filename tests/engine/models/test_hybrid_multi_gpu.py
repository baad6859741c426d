"""The trained hybrid at TP=2 on two CUDA devices: equal to TP=1, async scheduling equal to synchronous.
Marked `multi_gpu` by tests/conftest.py."""

from __future__ import annotations

from tests.engine.models.test_hybrid_gpu import (  # noqa: F401 (eager_k0 is a fixture)
    PROMPTS, agreement, check_async_scheduling_equals_synchronous, eager_k0, generate, pytestmark)


def test_tp2_equals_tp1(eager_k0):
    got, _ = generate(tensor_parallel_size=2, draft_tokens=3)
    print(f"\nTP=2 k=3 vs TP=1 k=0: {agreement(got, eager_k0)} of {48 * len(PROMPTS)} tokens agree")
    assert all(g[:16] == w[:16] for g, w in zip(got, eager_k0))


def test_async_scheduling_equals_synchronous_tp2(eager_k0):
    check_async_scheduling_equals_synchronous(tp=2)
