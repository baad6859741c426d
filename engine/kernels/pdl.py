"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's small Triton kernels.

A batch-1 decode step is ~750 kernels per rank (27B hybrid, TP=2), most of them 3-20 µs long; each
boundary costs the next kernel's launch and ramp-up while the GPU drains the last one. With PDL a
kernel is launched with the "programmatic stream serialization" attribute: its programs may start
as soon as every program of the kernel before it has called `gdc_launch_dependents` (or exited),
and they wait in `gdc_wait` until that kernel has finished and its memory is visible. A kernel may
touch only read-only data (weights) before its `gdc_wait`; every load of an activation and every
store comes after it, so the overlap can neither read early nor overwrite a buffer the kernel
before still reads. The chain is transitive: a kernel's wait returns after the kernel before it
finished, which itself waited for its own predecessor.

`gdc_wait` is a no-op in a kernel launched without the attribute, and the trigger is a no-op when
the next kernel is not a PDL launch, so kernels with and without PDL mix freely in a stream and in
a CUDA graph (stream capture keeps the programmatic edges). The idea is CUTLASS's and TensorRT-LLM's;
Triton exposes it as `launch_pdl=True` and `tl.extra.cuda.gdc_wait/gdc_launch_dependents`.

On by default on sm90+ CUDA devices; `NINFER_PDL=0` turns it off (the A/B of tools/dev/profile_decode.py: a 27B
hybrid TP=2 round 9.06 -> 8.68 ms with it, qwen3-8b 4.73 -> 4.51 ms; bench/results/2026-11-30-h200-pdl/).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine import envs
from engine.platform import paths_for

_ON: dict[int, bool] = {}


@triton.jit
def wait_for_inputs(USE_PDL: tl.constexpr):
    """Where a PDL kernel may start reading activations and storing: after the kernel before it has
    finished; then the kernel after it may launch its programs. Only weight loads go above this."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def enabled(device: torch.device) -> bool:
    """Whether kernels launched on `device` use PDL (constant for the process)."""
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _ON:                 # the environment is read once per device, not per launch
        _ON[idx] = (envs.PDL.read() and os.environ.get("TRITON_INTERPRET") != "1"
                    and _triton_launches_pdl() and paths_for(device).pdl)
    return _ON[idx]


def _triton_launches_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a Triton launch whose kernel takes a `USE_PDL: tl.constexpr`."""
    on = enabled(device)
    return {"USE_PDL": on, "launch_pdl": on} if on else {"USE_PDL": False}
