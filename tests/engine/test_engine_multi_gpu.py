"""The engine at TP=2 on two CUDA devices: equal to TP=1 (graphs, eager, async scheduling, MTP) and the
automatic KV capacity within every device's memory. Marked `multi_gpu` by tests/conftest.py."""

from __future__ import annotations

import pytest

from tests.engine.test_engine_gpu import (  # noqa: F401 (fp32_k0 is a fixture)
    _generate, _generate_mixed, check_automatic_kv_capacity, fp32_k0, needs_model)

pytestmark = [needs_model]


@pytest.mark.parametrize("tp_comm", ["p2p", "nccl"])
def test_tp2_equals_tp1_fp32(fp32_k0, tp_comm):
    assert _generate(dtype="float32", draft_tokens=0, tensor_parallel_size=2, tp_comm=tp_comm) == fp32_k0
    assert _generate(dtype="float32", draft_tokens=3, tensor_parallel_size=2, tp_comm=tp_comm) == fp32_k0


def test_tp2_async_scheduling_equals_synchronous_fp32():
    # every rank's graph replayed from the engine thread, rank 0 read one round late
    mixed = _generate_mixed(dtype="float32", draft_tokens=3, tensor_parallel_size=2, async_scheduling=False)
    assert _generate_mixed(dtype="float32", draft_tokens=3, tensor_parallel_size=2) == mixed


def test_tp2_eager_equals_tp1_fp32(fp32_k0):
    # the rank threads' eager path (the graphed one replays from the engine thread)
    assert _generate(dtype="float32", draft_tokens=3, tensor_parallel_size=2, enforce_eager=True) == fp32_k0


def test_automatic_kv_capacity_fits_both_devices():
    check_automatic_kv_capacity(tp=2)
