"""Compile Triton launches for NVIDIA targets on a machine without a GPU (Triton 3.6).

Inside `compile_for(arch)`, Triton's active driver is a stand-in for an sm_<arch> device and every
`kernel[grid](...)` is run with `warmup=True`: the kernel is specialized and compiled through Triton's own JIT
path (the same binder, specialization and options a GPU run uses, down to the cubin via ptxas) and is not
launched. The launch code runs unchanged on CPU tensors: the JIT reads only their dtypes and data pointers
(alignment). Yields the names of the kernels compiled inside.
"""

from __future__ import annotations

import contextlib

from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction


class _StandInDriver(DriverBase):
    def __init__(self, arch: int):
        self.arch = arch

    @classmethod
    def is_active(cls):
        return False

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("no launcher is built offline")

    def get_current_target(self):
        return GPUTarget("cuda", self.arch, 32)

    def get_current_device(self):
        return f"offline-sm{self.arch}"          # the JIT keeps one kernel cache per device: one per target

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError("no autotuning offline")


@contextlib.contextmanager
def compile_for(arch: int):
    compiled: list[str] = []
    real_run, previous_hook = JITFunction.run, knobs.runtime.jit_post_compile_hook

    def compile_only(self, *args, grid, warmup, **kwargs):
        return real_run(self, *args, grid=grid, warmup=True, **kwargs)

    def record(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        compiled.append(fn.jit_function.__name__)

    driver.set_active(_StandInDriver(arch))
    JITFunction.run = compile_only
    knobs.runtime.jit_post_compile_hook = record
    try:
        yield compiled
    finally:
        JITFunction.run = real_run
        knobs.runtime.jit_post_compile_hook = previous_hook
        driver._active = None
