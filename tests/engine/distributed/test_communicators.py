"""The CUDA communicators (engine/distributed/cuda_communicator.py) on any machine: the module imports without
CuPy and says what is missing, the gather helper, the check tool's NVLS guard, and the CUDA C sources compile for
sm_90 without spills where nvcc exists. On two GPUs: test_communicators_multi_gpu.py.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.distributed.cuda_communicator import KERNEL_SOURCE, gathered_to_last_dim

ROOT = Path(__file__).resolve().parents[3]


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

def test_nvls_variables_are_forced_off_by_the_check_tool():
    code = ("import os; os.environ['NCCL_NVLS_ENABLE'] = '1'\n"
            "import tools.dev.comm_check as c\n"
            "c.assert_nvls_off()\n"
            "assert os.environ['NCCL_NVLS_ENABLE'] == '0'\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
