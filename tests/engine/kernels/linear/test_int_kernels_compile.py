"""The integer weight-only kernels compile for sm_80, sm_89 and sm_90 without a GPU (tools/dev/int_kernels_compile.py:
Triton's ahead-of-time compile and its bundled ptxas), one decode and one prefill launch shape each, 4- and 8-bit
and act order, with nothing spilled to local memory. Runs in a subprocess without TRITON_INTERPRET (the
interpreter tests of this process may have replaced the kernels)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton ships no ptxas")
def test_int_kernels_compile_for_ampere_ada_and_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tools.dev.int_kernels_compile", "--targets", "80,89,90"],
                          cwd=Path(__file__).resolve().parents[4], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines()[1:]]
    assert len(rows) == 3 * 2 * 3 and {r[0] for r in rows} == {"sm_80", "sm_89", "sm_90"}
    assert all(r[-2:] == ["0", "0"] for r in rows), done.stdout           # no stack, no local memory: no spills
