"""The CUDA communicators (engine/distributed/cuda_communicator.py) against a reference sum, one thread per rank.

GPU tests need two CUDA devices and CuPy and are skipped elsewhere with the reason; the checks
themselves live in tools/dev/comm_check.py, which runs them (and the timings) on the GPU machine.
Two tests run on any machine: the module imports without CuPy, and the kernel source compiles
for sm_90 where nvcc exists.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.distributed.cuda_communicator import KERNEL_SOURCE, gathered_to_last_dim, make_communicator  # noqa: E402


def _gpu_skip_reason() -> str | None:
    if torch.cuda.device_count() < 2:
        return f"needs 2 CUDA devices (torch sees {torch.cuda.device_count()})"
    if importlib.util.find_spec("cupy") is None:
        return "needs CuPy (pip install 'ninfer[gpu]')"
    return None


_REASON = _gpu_skip_reason()


def multi_gpu(test):
    """Marked multi_gpu, and skipped with the reason where two GPUs or CuPy are missing."""
    return pytest.mark.multi_gpu(pytest.mark.skipif(_REASON is not None, reason=_REASON or "")(test))


# --------------------------------------------------------------------------------- any machine

def test_imports_without_cupy_and_says_what_is_missing():
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import engine.distributed.cuda_communicator as m\n"
        "for make in (lambda: m.NcclCommunicator([0, 1]), lambda: m.P2PCommunicator([0, 1])):\n"
        "    try:\n"
        "        make()\n"
        "    except RuntimeError as e:\n"
        "        assert 'CuPy' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError('constructed without CuPy')\n"
        "try:\n"
        "    m.make_communicator('fast', [0, 1])\n"
        "except ValueError as e:\n"
        "    assert 'fast' in str(e)\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_gathered_to_last_dim_matches_cat():
    parts = [torch.randn(2, 3, 5) for _ in range(3)]
    assert torch.equal(gathered_to_last_dim(torch.stack(parts)), torch.cat(parts, dim=-1))
    flat = [torch.randn(7) for _ in range(2)]
    assert torch.equal(gathered_to_last_dim(torch.stack(flat)), torch.cat(flat, dim=-1))


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile the kernel source")


def ptxas_report(tmp_path, source: str) -> tuple[str, list[str]]:
    """nvcc's -Xptxas -v output for `source` built as P2PCommunicator builds it (sm_90), and its spill lines."""
    src = tmp_path / "k.cu"
    src.write_text(source)
    out = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-cubin", "-Xptxas", "-v",
                          "-o", str(tmp_path / "k.cubin"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stderr, [line for line in out.stderr.splitlines() if "spill stores" in line]


def no_spills(spills: list[str]) -> bool:
    return bool(spills) and all(" 0 bytes spill stores, 0 bytes spill loads" in s for s in spills)


@needs_nvcc
def test_kernel_source_compiles_for_sm90_without_spills(tmp_path):
    report, spills = ptxas_report(tmp_path, KERNEL_SOURCE)
    assert report.count("Compiling entry function") == 6, report
    assert len(spills) == 6 and no_spills(spills), spills


@needs_nvcc
def test_fused_add_norm_source_compiles_for_sm90_without_spills(tmp_path):
    from engine.distributed.fused_allreduce import ADD_NORM_KERNEL_NAMES, ADD_NORM_SOURCE
    report, spills = ptxas_report(tmp_path, KERNEL_SOURCE + ADD_NORM_SOURCE)
    for name in ADD_NORM_KERNEL_NAMES.values():
        assert f"Compiling entry function '{name}'" in report, report
    assert len(spills) == 9 and no_spills(spills), spills


@needs_nvcc
def test_push_source_compiles_for_sm90_without_spills(tmp_path):
    from engine.distributed.p2p_push import PUSH_KERNEL_NAMES, PUSH_SOURCE
    from engine.distributed.fused_allreduce import ADD_NORM_SOURCE
    report, spills = ptxas_report(tmp_path, KERNEL_SOURCE + ADD_NORM_SOURCE + PUSH_SOURCE)
    for name in PUSH_KERNEL_NAMES.values():
        assert f"Compiling entry function '{name}'" in report, report
    assert no_spills(spills), spills


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


def test_nvls_variables_are_forced_off_by_the_check_tool():
    code = ("import os; os.environ['NCCL_NVLS_ENABLE'] = '1'\n"
            "import tools.dev.comm_check as c\n"
            "c.assert_nvls_off()\n"
            "assert os.environ['NCCL_NVLS_ENABLE'] == '0'\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})


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


@multi_gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("kind", ["p2p", "push"])
def test_fused_add_norm_sums_k_split_partials(comms, graph, kind):
    # x: [S, T, H] partials of S slices of K (RowParallelLinear.k_splits), summed before the exchange
    from tools.dev.tp_fuse_check import check_fused
    _assert_fused_ok(check_fused(comms[kind], FUSED_SHAPES[:3], splits=4, graph=graph))
