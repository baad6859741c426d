"""Compile the engine's real Triton launches for NVIDIA targets on a machine with no GPU (Triton 3.6).

The engine's own launch code runs once with CPU tensors while a stand-in driver is active: every
`kernel[grid](...)` is intercepted by Triton's `jit_cache_hook`, which records the launch's specialization
(signature, constexprs, divisibility attributes, options) and tells the JIT to skip it, so nothing compiles
or runs. Each record is then compiled with `triton.compile(ASTSource(...), target=GPUTarget("cuda", cap, 32))`
for every capability asked, down to cubin (ptxas included): the code a GPU of that capability would load.

CPU tensors stand in for CUDA ones: the JIT reads only their dtype and data_ptr() (16-byte alignment; the
CPU allocator aligns to 64 bytes, CUDA's to 256, so fresh tensors specialize alike).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Callable, Iterator

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.compiler import ASTSource
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

# options that parse_options derives from the target: dropped when compiling a record for another target
TARGET_DERIVED_OPTIONS = ("arch", "supported_fp8_dtypes", "deprecated_fp8_dot_operand_dtypes",
                          "max_num_imprecise_acc_default")


class StandInCudaDriver(DriverBase):
    """What JITFunction.run needs to bind and specialize a launch: a target, a device name, a stream."""

    def __init__(self, capability: int, device: str):
        self.capability = capability
        self.device = device

    @classmethod
    def is_active(cls):
        return False

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("the stand-in driver builds no launcher")

    def get_current_target(self):
        return GPUTarget("cuda", self.capability, 32)

    def get_current_device(self):
        return self.device

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError("no autotuning without a GPU")


def _as_tuples(value):
    """JSON made the options' tuples lists; the compile options must stay hashable."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


@dataclass
class Launch:
    """One distinct specialization of a @triton.jit kernel, as the engine's launch code made it."""

    scenario: str
    fn: JITFunction
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict

    @property
    def kernel(self) -> str:
        return self.fn.__name__

    def compile(self, capability: int):
        """The CompiledKernel for sm_<capability> (its asm holds the PTX and the cubin)."""
        options = {k: _as_tuples(v) for k, v in self.options.items() if k not in TARGET_DERIVED_OPTIONS}
        source = ASTSource(self.fn, self.signature, self.constexprs, self.attrs)
        return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


_captures = 0


def _skip_launch_run(self, *args, grid, warmup, **kwargs):
    return _ORIGINAL_RUN(self, *args, grid=grid, warmup=True, **kwargs)


_ORIGINAL_RUN = JITFunction.run


@contextlib.contextmanager
def capture_launches(scenario: str) -> Iterator[list[Launch]]:
    """Inside, every JIT launch is recorded (once per specialization) and neither compiled nor run."""
    global _captures
    records: list[Launch] = []
    seen: set = set()
    previous_hook = knobs.runtime.jit_cache_hook

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        marker = (id(fn.jit_function), str(key))
        if marker not in seen:
            seen.add(marker)
            spec = json.loads(compile["specialization_data"])
            records.append(Launch(scenario, fn.jit_function, dict(compile["signature"]), dict(compile["constants"]),
                                  dict(compile["configs"][0]), spec["options"]))
        return True            # "already handled": run() returns without compiling or launching

    _captures += 1             # a fresh device name: no kernel cached by an earlier capture hides a launch
    driver.set_active(StandInCudaDriver(90, f"capture-{_captures}"))
    JITFunction.run = _skip_launch_run
    knobs.runtime.jit_cache_hook = hook
    try:
        yield records
    finally:
        JITFunction.run = _ORIGINAL_RUN
        knobs.runtime.jit_cache_hook = previous_hook
        driver._active = None  # back to "no driver chosen" (reset_active() would look for a real one)


@dataclass(frozen=True)
class CompileResult:
    scenario: str
    kernel: str
    capability: int
    ok: bool
    error: str = ""
    local_bytes: int = -1      # stack + local memory of the cubin (spills), where measured; -1: not measured


def local_memory_bytes(cubin: bytes) -> int:
    """Stack plus local memory of a cubin's kernel (register spills), as the cuobjdump Triton ships reports it."""
    import os
    import re
    import subprocess
    import tempfile
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return sum(int(v) for v in re.findall(r"(?:STACK|LOCAL):(\d+)", usage))


def first_error_line(error: BaseException) -> str:
    """The line that says why: ptxas's own "error   :" line before Triton's summary of it."""
    text = str(error).strip() or type(error).__name__
    lines = text.splitlines()
    for line in lines:
        if "error   :" in line:
            return line.split("error   :", 1)[1].strip()[:300]
    for line in lines:
        if "error" in line.lower():
            return line.strip()[:300]
    return lines[0][:300]


def compile_scenarios(scenarios: dict[str, Callable[[], None]], capabilities: dict[str, tuple[int, ...]],
                      spill_checked: frozenset[str] = frozenset()) -> list[CompileResult]:
    """Capture each scenario's launches, then compile each for the capabilities listed for it (and measure the
    local memory of the scenarios in `spill_checked`)."""
    results: list[CompileResult] = []
    for name, run in scenarios.items():
        with capture_launches(name) as launches:
            run()
        if not launches:
            raise RuntimeError(f"scenario {name} launched no Triton kernel")
        for launch in launches:
            for cap in capabilities[name]:
                try:
                    kernel = launch.compile(cap)
                except Exception as error:  # noqa: BLE001 - the matrix records why a target fails
                    results.append(CompileResult(name, launch.kernel, cap, False, first_error_line(error)))
                    continue
                local = local_memory_bytes(kernel.asm["cubin"]) if name in spill_checked else -1
                results.append(CompileResult(name, launch.kernel, cap, True, local_bytes=local))
    return results


def main(argv: list[str] | None = None) -> None:
    """python -m tests.support.compile_matrix OUT.json [--full]: run in a fresh process (Triton must not be
    in interpreter mode, which the kernel tests switch on) and write every (scenario, kernel, capability) result."""
    import argparse
    import dataclasses
    import time
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    args = parser.parse_args(argv)
    from tests.support.compile_scenarios import scenarios
    table = scenarios(args.full)
    if args.only:
        table = {k: v for k, v in table.items() if k in args.only.split(",")}
    import resource

    from tests.support import nvrtc
    t0, cpu0 = time.perf_counter(), time.process_time()
    spill_checked = frozenset(k for k, v in table.items() if v[0] == "int_linear")
    results = compile_scenarios({k: v[1] for k, v in table.items()}, {k: v[2] for k, v in table.items()},
                                spill_checked)
    families = {k: v[0] for k, v in table.items()}
    # the CUDA C, through NVRTC where its library is installed (the test extra's nvidia-cuda-nvrtc)
    library, nvrtc_cpu0 = nvrtc.find_libnvrtc(), time.process_time()
    if library and not args.only:
        for name, source in nvrtc.engine_cuda_sources().items():
            families[name] = source.family
            results += [CompileResult(name, "+".join(source.files), cap, *nvrtc.try_compile(library, source, cap))
                        for cap in source.targets]
    nvrtc_cpu = time.process_time() - nvrtc_cpu0
    children = resource.getrusage(resource.RUSAGE_CHILDREN)          # ptxas runs as a child process
    with open(args.out, "w") as f:
        json.dump({"seconds": time.perf_counter() - t0,
                   "cpu_seconds": time.process_time() - cpu0 + children.ru_utime + children.ru_stime,
                   "nvrtc": {"library": library, "version": nvrtc.version(library), "cpu_seconds": nvrtc_cpu}
                   if library else None,
                   "families": families,
                   "results": [dataclasses.asdict(r) for r in results]}, f, indent=1)


if __name__ == "__main__":
    main()
