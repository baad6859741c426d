"""Launch-plan rules of the paged-attention kernel (engine/kernels/attention/paged.py `plan`) that read shapes and
lengths only: they run on any CPU with Triton installed, without the interpreter (the CPU plans as for an H200's
132 SMs). The kernel module imports Triton, which the CPU test install does not carry: skipped there."""

from __future__ import annotations

import importlib.util

import pytest
import torch

# find_spec, not import: importing triton at collection would fix its language module before the interpreter
# tests of the same session could patch it
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton importable")

BF16, I8 = torch.bfloat16, torch.int8


def test_bf16_long_context_plan_rules(monkeypatch):
    """16-bit pages, batch-1 decode past one-tile splits (at least BF16_LONG_MIN_SPLITS splits, whatever the
    context bound: a graph plans for its class): prefetch 1, one stage, 128 registers; batch 8 (8 splits), one-tile
    splits and int8 pages keep their plans; NINFER_ATTN_BF16_LONG=0 (BF16_LONG False) restores the cp.async
    pipeline. The plan reads shapes only (the CPU plans as for 132 SMs)."""
    from engine.kernels.attention import paged as A
    from tests.support import kernel_checks as testing
    cases = {(1, 32768): True, (1, 8192): True, (1, 131072): True, (8, 8192): False, (1, 512): False}
    for (batch, keys), takes in cases.items():
        q, kv, ctx = testing.attention_case([1] * batch, [keys] * batch, 32, 8, 128, 16, BF16, BF16, "cpu", seed=2)
        cfg = A.plan(q, kv, ctx)
        assert ((cfg.prefetch, cfg.num_stages, cfg.max_regs) == (1, 1, 128)) == takes, (batch, keys, cfg)
        if takes:
            assert cfg.num_splits >= A.BF16_LONG_MIN_SPLITS
            monkeypatch.setattr(A, "BF16_LONG", False)
            old = A.plan(q, kv, ctx)
            monkeypatch.setattr(A, "BF16_LONG", True)
            assert (old.prefetch, old.num_stages, old.max_regs) == (0, A.DECODE["num_stages"], 0), old
    q, kv, ctx = testing.attention_case([1], [32768], 32, 8, 128, 16, I8, BF16, "cpu", seed=3)
    assert A.plan(q, kv, ctx).max_regs == 0
    # float32 pages (allowed on CUDA; not timed with it): the cp.async pipeline
    q, kv, ctx = testing.attention_case([1], [32768], 32, 8, 128, 16, torch.float32, torch.float32, "cpu", seed=4)
    assert A.plan(q, kv, ctx).max_regs == 0

