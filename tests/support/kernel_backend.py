"""Where a Triton kernel test runs: on a CUDA device, or under Triton's interpreter on the CPU when
NINFER_TRITON_INTERPRET_TESTS=1 (opt-in: the interpreter is slow). Import this before the kernels are
defined: in the interpreter case it sets TRITON_INTERPRET=1, which Triton reads when a kernel is decorated."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from engine import envs

CUDA = torch.cuda.is_available()
INTERPRET = envs.TRITON_INTERPRET_TESTS.read() and importlib.util.find_spec("triton") is not None
if INTERPRET and not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
DEV = "cuda" if CUDA else "cpu"
needs_a_backend = pytest.mark.skipif(not (CUDA or INTERPRET),
                                     reason="needs a CUDA device, or triton with NINFER_TRITON_INTERPRET_TESTS=1")
