"""The fused all-reduce + residual add + RMSNorm on the CPU: its math against the unfused ops, and
the decoder layers' wiring (engine.layers.reduce_add_norm).

The CUDA kernel itself runs in tests/engine/distributed/test_communicators_multi_gpu.py (against `add_norm_reference`, eagerly
and in CUDA graphs). Here: the reference equals what the CPU TP path computes with the unfused ops
(LocalCommunicator's all-reduce, then RMSNorm / ZeroCentredRMSNorm with the residual), and a
communicator that offers the fused call (the in-process one, extended with the reference) receives
every "all-reduce; add; norm" of both model families, while TP=2 still computes what TP=1 does.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_llm
from engine import SamplingParams
from engine.layers.hybrid_norm import ZeroCentredRMSNorm
from engine.layers.norm import RMSNorm
from engine.distributed.tp_group import LocalCommunicator
from engine.distributed.fused_allreduce import add_norm_launch_shape, add_norm_reference
from tests.support.hybrid import require_shared_hybrid
from tests.engine.distributed.test_tp_cpu import on_ranks

EPS = 1e-6


@pytest.mark.parametrize("zero_centred", [False, True], ids=["rmsnorm", "zero-centred"])
@pytest.mark.parametrize("world, dtype", [(2, torch.bfloat16), (2, torch.float32), (3, torch.float32)])
def test_reference_equals_the_unfused_ops(world, dtype, zero_centred):
    gen = torch.Generator().manual_seed(world)
    rows, hidden = 5, 256
    parts = [torch.randn(rows, hidden, generator=gen).to(dtype) for _ in range(world)]
    residual = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    norm = (ZeroCentredRMSNorm if zero_centred else RMSNorm)(hidden, EPS).to(dtype)
    norm.weight.data.copy_(torch.randn(hidden, generator=gen) * 0.5)

    def unfused(group):
        return norm(group.all_reduce(parts[group.rank].clone()), residual)

    want_out, want_residual = add_norm_reference(parts, residual, norm.weight.data, EPS, zero_centred)
    for out, new_residual in on_ranks(world, unfused):
        assert torch.equal(new_residual, want_residual)
        assert torch.equal(out, want_out)


def test_launch_shape_depends_on_sizes_only():
    assert add_norm_launch_shape(1, 4096 * 2, 64) == (1, 512, 512)           # one token, hidden 4096 bf16
    assert add_norm_launch_shape(64, 5120 * 2, 64) == (64, 640, 640)
    assert add_norm_launch_shape(4096, 8192 * 2, 64) == (64, 1024, 1024)     # rows stride over 64 blocks
    assert add_norm_launch_shape(3, 64 * 4, 64) == (3, 32, 16)               # at least one warp


class FusedReferenceCommunicator(LocalCommunicator):
    """The in-process ranks with the fused call the CUDA communicator offers, computed by
    `add_norm_reference`; counts the calls (and the zero-centred ones) per rank."""

    def __init__(self, world_size: int):
        super().__init__(world_size)
        self.fused_calls = [0] * world_size
        self.zero_centred_calls = [0] * world_size
        self.plain_calls = [0] * world_size

    def all_reduce(self, rank, x):
        self.plain_calls[rank] += 1
        return super().all_reduce(rank, x)

    def all_reduce_add_rms_norm(self, rank, x, residual, weight, eps, zero_centred=False):
        self.fused_calls[rank] += 1
        self.zero_centred_calls[rank] += int(zero_centred)
        parts = self._exchange(rank, x.clone())
        return add_norm_reference(parts, residual, weight, eps, zero_centred)


@pytest.fixture
def fused_comm(monkeypatch):
    made = []

    def make(world_size):
        comm = FusedReferenceCommunicator(world_size)
        made.append(comm)
        return comm
    monkeypatch.setattr("engine.distributed.executor.LocalCommunicator", make)
    return made


PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "Line 1: the quick brown fox jumps over the lazy dog.\nLine 2:"]


def _check_wiring(path: str, fused_comm, zero_centred: bool, **kw):
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    want = [o.token_ids for o in make_llm(path, **kw).generate(PROMPTS, params)]
    two = make_llm(path, tensor_parallel_size=2, **kw)
    comm = fused_comm[-1]
    model = two.engine.executor.driver.model
    layer_calls = []
    for layer in list(model.model.layers) + list(model.mtp.layers):
        layer.register_forward_hook(lambda *_: layer_calls.append(1))
    before = (list(comm.fused_calls), list(comm.plain_calls))
    two.prompt_logits(PROMPTS[0])
    fused = [a - b for a, b in zip(comm.fused_calls, before[0])]
    plain = [a - b for a, b in zip(comm.plain_calls, before[1])]
    # each layer's two sums are fused (the first layer's input norm has none to fuse; the final
    # norm's is): two per layer forward; embedding and logits stay plain all-reduces
    assert fused[0] == fused[1] and plain[0] == plain[1] and plain[0] >= 2
    assert len(layer_calls) > 0 and fused[0] == 2 * len(layer_calls), (fused, plain, len(layer_calls))
    assert (comm.zero_centred_calls[0] > 0) == zero_centred
    got = [o.token_ids for o in two.generate(PROMPTS, params)]
    assert got == want


def test_qwen3_layers_hand_every_sum_to_the_fused_call(shared_model, fused_comm):
    _check_wiring(shared_model, fused_comm, zero_centred=False, draft_tokens=3)


def test_hybrid_layers_hand_every_sum_to_the_fused_call(fused_comm):
    _check_wiring(require_shared_hybrid(), fused_comm, zero_centred=True, draft_tokens=3)


def test_defer_reduce_leaves_partial_sums_only_with_several_ranks():
    from engine.layers.linear import RowParallelLinear
    from engine.layers.reduce_add_norm import defer_reduce
    for comm in (LocalCommunicator(2), FusedReferenceCommunicator(2)):
        group = comm.groups()[0]
        layer = RowParallelLinear(128, 64, group)
        assert defer_reduce(group, layer) and not layer.reduce
    one = RowParallelLinear(128, 64)
    assert not defer_reduce(one.tp, one) and one.reduce
