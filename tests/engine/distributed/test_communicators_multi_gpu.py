"""The CUDA communicators (engine/distributed/cuda_communicator.py) on two GPUs, against a reference sum, one
thread per rank: NCCL, the one-shot P2P all-reduce and its push variant, eager and in CUDA graphs, and the fused
all-reduce + residual add + RMSNorm. The checks live in tools/dev/comm_check.py, which also times them on the GPU
machine. Marked multi_gpu by tests/conftest.py; skipped without two CUDA devices or without CuPy.
"""

import importlib.util

import pytest
import torch

from engine.distributed.cuda_communicator import make_communicator

_REASON = None if importlib.util.find_spec("cupy") is not None else "needs CuPy (pip install 'ninfer[gpu]')"


def multi_gpu(test):
    """Skipped with the reason where CuPy is missing (tests/conftest.py skips without two GPUs)."""
    return pytest.mark.skipif(_REASON is not None, reason=_REASON or "")(test)


# --------------------------------------------------------------------------------- two GPUs

@pytest.fixture(scope="module")
def comms():
    from engine.distributed.cuda_communicator import NcclCommunicator, P2PCommunicator
    nccl = NcclCommunicator([0, 1])
    p2p = P2PCommunicator([0, 1], fallback=nccl, timeout_s=30.0, push_max_bytes=0)
    # the push variant (engine.distributed.p2p_push) for 16-bit messages up to 64 KB, the pull kernels above that
    push = P2PCommunicator([0, 1], fallback=nccl, timeout_s=30.0, push_max_bytes=64 * 1024)
    yield {"nccl": nccl, "p2p": p2p, "push": push}
    push.close()
    p2p.close()
    nccl.close()


def _failures(records):
    assert records, "no checks ran"
    return [r for r in records if not r["ok"]]


@multi_gpu
@pytest.mark.parametrize("kind", ["nccl", "p2p", "push"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_all_reduce_eager_from_rank_threads(comms, kind, dtype):
    from tools.dev.comm_check import check_all_reduce_eager
    sizes = (1, 3, 2048, 4096, 4097, 12345, 32768, 262144, 262145, 524288)
    assert not _failures(check_all_reduce_eager(comms[kind], dtype, sizes=sizes, rounds=3))


@multi_gpu
@pytest.mark.parametrize("kind", ["nccl", "p2p", "push"])
def test_all_reduce_fp16(comms, kind):
    from tools.dev.comm_check import check_all_reduce_eager
    assert not _failures(check_all_reduce_eager(comms[kind], torch.float16, sizes=(7, 4096, 32768), rounds=1))


@multi_gpu
@pytest.mark.parametrize("kind", ["nccl", "p2p", "push"])
def test_dependent_chain_reuses_buffers_correctly(comms, kind):
    from tools.dev.comm_check import check_chain
    assert not _failures(check_chain(comms[kind], steps=300))


@multi_gpu
@pytest.mark.parametrize("kind", ["nccl", "p2p", "push"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_graph_per_rank_follows_new_inputs(comms, kind, dtype):
    from tools.dev.comm_check import check_graph
    assert not _failures(check_graph(comms[kind], dtype, replays=4))


@multi_gpu
@pytest.mark.parametrize("kind", ["nccl", "p2p"])
def test_all_gather_concatenates_last_dim(comms, kind):
    from tools.dev.comm_check import check_all_gather
    assert not _failures(check_all_gather(comms[kind]))


@multi_gpu
def test_groups_route_to_the_communicator(comms):
    from tools.dev.comm_check import run_ranks
    groups = comms["p2p"].groups()
    assert [(g.rank, g.size, g.comm) for g in groups] == [(0, 2, comms["p2p"]), (1, 2, comms["p2p"])]

    def body(rank, barrier):
        x = torch.full((4096,), float(rank + 1), dtype=torch.bfloat16, device=f"cuda:{rank}")
        y = groups[rank].all_reduce(x)
        torch.cuda.synchronize()
        return bool((y == 3).all()) and y is x

    assert run_ranks([0, 1], body) == [True, True]


@multi_gpu
def test_wrong_device_is_refused(comms):
    with pytest.raises(ValueError, match="cuda:1"):
        comms["nccl"].all_reduce(1, torch.ones(4, device="cuda:0"))


@multi_gpu
def test_make_communicator_auto_prefers_p2p_where_peer_access_works():
    comm = make_communicator("auto", [0, 1], timeout_s=30.0)
    try:
        peer = all(torch.cuda.can_device_access_peer(i, j) for i, j in ((0, 1), (1, 0)))
        assert comm.kind == ("p2p" if peer else "nccl")
    finally:
        comm.close()



# ------------------------------------------------------ fused all-reduce + residual add + RMSNorm

FUSED_SHAPES = [(1, 4096), (3, 5120), (8, 4096), (51, 5120), (65, 2048), (1, 1024)]   # all <= 512 KB


def _assert_fused_ok(records):
    assert records, "no checks ran"
    bad = [r for r in records if not r["ok"]]
    assert not bad, "\n".join(str(r) for r in bad[:5])


@multi_gpu
@pytest.mark.parametrize("zero_centred", [False, True], ids=["rmsnorm", "zero-centred"])
@pytest.mark.parametrize("kind", ["p2p", "push"])
def test_fused_add_norm_eager_equals_reference_and_unfused_ops(comms, zero_centred, kind):
    from tools.dev.tp_fuse_check import check_fused
    records = check_fused(comms[kind], FUSED_SHAPES, zero_centred=zero_centred)
    _assert_fused_ok(records)
    fused = [r for r in records if "rows" in r]
    assert all(r["unfused_residual_equal"] and r["out_max_ulps_vs_unfused"] <= 2.0 for r in fused), fused


@multi_gpu
@pytest.mark.parametrize("zero_centred", [False, True], ids=["rmsnorm", "zero-centred"])
@pytest.mark.parametrize("kind", ["p2p", "push"])
def test_fused_add_norm_in_cuda_graphs_follows_new_inputs(comms, zero_centred, kind):
    from tools.dev.tp_fuse_check import check_fused
    _assert_fused_ok(check_fused(comms[kind], FUSED_SHAPES[:4], zero_centred=zero_centred, graph=True, replays=3))


@multi_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kind", ["p2p", "push"])
def test_fused_add_norm_other_dtypes(comms, dtype, kind):
    from tools.dev.tp_fuse_check import check_fused
    _assert_fused_ok(check_fused(comms[kind], [(2, 4096), (5, 1024)], dtype=dtype, zero_centred=dtype == torch.float16))


@multi_gpu
def test_fused_add_norm_above_the_limit_falls_back_to_the_unfused_ops(comms):
    from engine.layers.norm import RMSNorm
    from engine.layers.reduce_add_norm import reduce_add_norm
    from engine.distributed.fused_allreduce import add_norm_reference
    from tools.dev.comm_check import run_ranks
    comm = comms["p2p"]
    rows, hidden = 80, 4096                                     # 640 KB of bf16 > the 512 KB limit
    gen = torch.Generator().manual_seed(5)
    parts = [torch.randn(rows, hidden, generator=gen).to(torch.bfloat16) for _ in range(2)]
    residual = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    weight = torch.randn(hidden, generator=gen).to(torch.bfloat16)
    groups = comm.groups()

    def body(rank, barrier):
        dev = f"cuda:{rank}"
        norm = RMSNorm(hidden, 1e-6).to(device=dev, dtype=torch.bfloat16)
        norm.weight.data.copy_(weight)
        x, res = parts[rank].to(dev), residual.to(dev)
        refused = comm.all_reduce_add_rms_norm(rank, x, res, norm.weight, 1e-6) is None
        out, new_res = reduce_add_norm(groups[rank], norm, x, res)
        torch.cuda.synchronize()
        return refused, out.cpu(), new_res.cpu()

    got = run_ranks([0, 1], body)
    want_out, want_res = add_norm_reference(parts, residual, weight, 1e-6)
    for refused, out, new_res in got:
        assert refused
        assert torch.equal(new_res, want_res)                   # two ranks: NCCL's sum rounds once too
        torch.testing.assert_close(out, want_out, rtol=2 ** -7, atol=1e-2)

