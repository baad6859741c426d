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
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from tests.support.compile_matrix import StandInCudaDriver


@contextlib.contextmanager
def compile_for(arch: int):
    compiled: list[str] = []
    real_run, previous_hook = JITFunction.run, knobs.runtime.jit_post_compile_hook

    def compile_only(self, *args, grid, warmup, **kwargs):
        return real_run(self, *args, grid=grid, warmup=True, **kwargs)

    def record(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        compiled.append(fn.jit_function.__name__)

    driver.set_active(StandInCudaDriver(arch, f"offline-sm{arch}"))   # one JIT cache per target
    JITFunction.run = compile_only
    knobs.runtime.jit_post_compile_hook = record
    try:
        yield compiled
    finally:
        JITFunction.run = real_run
        knobs.runtime.jit_post_compile_hook = previous_hook
        driver._active = None
