"""The decode round's bookkeeping kernels (engine/kernels/elementwise/round_prep.py) against the torch ops of
engine.worker.decode_round they replace on CUDA: equal outputs, bit for bit, for random batches, padding rows and
carried rows. On a CUDA device (marked gpu), or under Triton's interpreter on the CPU when
NINFER_TRITON_INTERPRET_TESTS=1; plus the captured form on a device."""

from __future__ import annotations

import pytest
import torch

from tests.support.kernel_backend import CUDA, DEV, INTERPRET, needs_a_backend  # noqa: F401 (sets TRITON_INTERPRET first)

pytestmark = needs_a_backend


def _twin(monkeypatch):
    from engine.worker import decode_round
    monkeypatch.setattr(decode_round, "FUSED_ROUND_PREP", False)
    return decode_round


def _round_inputs(bsz: int, k: int, max_batch: int, seed: int):
    from engine.worker.decode_round import FLOAT_ROWS, ROWS, RoundInputs
    g = torch.Generator().manual_seed(seed)
    ints = torch.randint(0, 500, (ROWS * bsz + bsz * (k + 1),), generator=g)
    carry = ints[10 * bsz:11 * bsz]                                                   # -1 = not carried
    carry.copy_(torch.randint(-1, max_batch, (bsz,), generator=g))
    carry[0] = 3
    carry[1:2] = -1                                                                    # both kinds where B > 1
    floats = torch.rand(FLOAT_ROWS * bsz, generator=g)
    tables = torch.randint(0, 1000, (bsz, 64), generator=g, dtype=torch.int32)
    inp = RoundInputs.from_packed(ints.to(DEV), floats.to(DEV), tables.to(DEV), k)
    # each row of the last round: accepted + 1 tokens, then -1 (a row of all -1 too: never read, still defined)
    last = torch.randint(0, 30_000, (max_batch, k + 1), generator=g)
    emitted = torch.randint(0, k + 2, (max_batch,), generator=g)
    last[torch.arange(k + 1)[None, :] >= emitted[:, None]] = -1
    return inp, last.to(DEV)


@pytest.mark.parametrize("bsz,query_len,block_size", [(1, 1, 16), (5, 4, 16), (16, 1, 64), (3, 8, 16), (64, 2, 32)])
def test_uniform_context_equals_the_torch_ops(monkeypatch, bsz, query_len, block_size):
    from engine.kernels.elementwise import round_prep
    dr = _twin(monkeypatch)
    g = torch.Generator().manual_seed(bsz * 100 + query_len)
    tables = torch.randint(0, 5000, (bsz, 40), generator=g, dtype=torch.int32).to(DEV)
    start = torch.randint(0, 40 * block_size - query_len, (bsz,), generator=g).to(DEV)
    start[0] = 0                                                     # a padding row starts at position 0
    positions, ctx = dr.uniform_context(start, query_len, tables, block_size, max_seq_len=4096)
    got = round_prep.uniform_context(start, query_len, tables, block_size)
    want = (positions, ctx.slot_mapping, ctx.seq_lens, ctx.query_start_loc)
    for name, a, b in zip(("positions", "slot_mapping", "seq_lens", "query_start_loc"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("bsz,k", [(1, 1), (4, 3), (8, 0), (13, 2)])
def test_carry_forward_equals_the_torch_ops(monkeypatch, bsz, k):
    from engine.kernels.elementwise import round_prep
    dr = _twin(monkeypatch)
    inp, last = _round_inputs(bsz, k, max_batch=16, seed=bsz + k)
    want = dr.carry_forward(inp, last)
    got = round_prep.carry_forward(inp.carry_rows, last, inp.last_ids, inp.num_tokens, inp.mtp_counts, inp.mtp_ids,
                                   inp.output_index)
    for name, a in zip(("last_ids", "num_tokens", "mtp_counts", "mtp_ids", "output_index"), got):
        assert torch.equal(a, getattr(want, name)), name
    assert (inp.carry_rows >= 0).any() and (bsz == 1 or (inp.carry_rows < 0).any())


def test_carry_forward_refuses_mismatched_widths():
    from engine.kernels.elementwise import round_prep
    z = torch.zeros(2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="k\\+1 wide"):
        round_prep.carry_forward(z, torch.zeros(4, 3, dtype=torch.int64, device=DEV), z, z, z,
                                 torch.zeros(2, 2, dtype=torch.int64, device=DEV), z)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_captured_round_prep_replays_new_inputs(monkeypatch):
    from engine.kernels.elementwise import round_prep
    dr = _twin(monkeypatch)
    tables = torch.randint(0, 5000, (8, 40), dtype=torch.int32, device=DEV)
    start = torch.randint(0, 500, (8,), device=DEV)
    round_prep.uniform_context(start, 4, tables, 16)                  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = round_prep.uniform_context(start, 4, tables, 16)
    start.copy_(torch.randint(0, 500, (8,), device=DEV))
    graph.replay()
    positions, ctx = dr.uniform_context(start, 4, tables, 16, max_seq_len=4096)
    torch.cuda.synchronize()
    assert torch.equal(got[0], positions) and torch.equal(got[1], ctx.slot_mapping)
