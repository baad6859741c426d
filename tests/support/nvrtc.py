"""CUDA C -> cubin for a chosen target with NVRTC through ctypes: no GPU, no driver, no CuPy.

libnvrtc comes from the NVIDIA wheel the test extra pins (`nvidia-cuda-nvrtc`, CUDA 13: sm75 and newer; its
12.x wheel reaches sm50; 58 MB to download, 141 MB installed), found under site-packages' nvidia/*/lib, or
named by NINFER_NVRTC_LIB. Not in the runtime install: on a GPU machine CuPy brings its own NVRTC.
`engine_cuda_sources` lists every `.cu` file under engine/ as the engine assembles it for NVRTC; the compile
matrix (tests/support/compile_matrix.py) compiles each for the matrix's targets."""

from __future__ import annotations

import ctypes
import glob
import os
import site
from dataclasses import dataclass

TARGETS = (70, 75, 80, 89, 90)          # the compile matrix's capabilities


def find_libnvrtc() -> str | None:
    from engine import envs
    named = envs.NVRTC_LIB.read()
    if named:
        return named
    for root in site.getsitepackages():
        hits = sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so.*"))
                      + glob.glob(os.path.join(root, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.*")))
        hits = [h for h in hits if "builtins" not in h and ".alt." not in h]
        if hits:
            return hits[0]
    return None


class NvrtcError(RuntimeError):
    pass


def compile_cubin(lib_path: str, source: str, capability: int, name_expressions: tuple[str, ...] = (),
                  options: tuple[str, ...] = ("-std=c++17",)) -> bytes:
    """The cubin NVRTC makes of `source` for sm_<capability>, with each templated kernel name instantiated."""
    for builtins in glob.glob(os.path.join(os.path.dirname(lib_path), "libnvrtc-builtins.so.*")):
        if ".alt." not in builtins:
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)     # NVRTC opens it by name at compile time
    lib = ctypes.CDLL(lib_path)
    program = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"kernel.cu", 0, None, None):
        raise NvrtcError("nvrtcCreateProgram failed")
    try:
        for name in name_expressions:
            lib.nvrtcAddNameExpression(program, name.encode())
        args = [o.encode() for o in (*options, f"-arch=sm_{capability}")]
        status = lib.nvrtcCompileProgram(program, len(args), (ctypes.c_char_p * len(args))(*args))
        if status:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(program, log)
            lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            reason = lib.nvrtcGetErrorString(status).decode()
            options_text = " ".join(a.decode() for a in args)
            text = log.value.decode(errors="replace").strip() or f"nvrtcCompileProgram: {reason} ({options_text})"
            if "libnvrtc-builtins" in text:
                raise RuntimeError(f"a broken NVRTC install, not a compile error: {text}")
            raise NvrtcError(text)
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(program, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(program, cubin)
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


@dataclass(frozen=True)
class CudaSource:
    family: str                         # the engine/platform.py family that launches it
    files: tuple[str, ...]              # the .cu files (under engine/) it is made of
    text: str                           # the source exactly as the engine hands it to NVRTC
    names: tuple[str, ...] = ()         # templated kernels to instantiate (name expressions)
    targets: tuple[int, ...] = TARGETS  # the capabilities to compile it for


def engine_cuda_sources() -> dict[str, CudaSource]:
    """Every CUDA C module the engine compiles at run time, assembled as the engine assembles it."""
    from engine.distributed import cuda_communicator, p2p_push
    from engine.kernels.linear import quant_gemv_mma as mma
    allreduce = ("engine/distributed/one_shot_allreduce.cu", "engine/distributed/allreduce_add_norm.cu",
                 "engine/distributed/push_allreduce.cu")
    return {
        # the P2P communicator's module: the one-shot all-reduce, its fused add+RMSNorm, the push all-reduce
        "cuda_p2p_allreduce": CudaSource("tp_allreduce", allreduce, cuda_communicator.KERNEL_SOURCE
                                         + cuda_communicator.ADD_NORM_SOURCE + p2p_push.PUSH_SOURCE),
        # the NVFP4 / FP8 tensor-core GEMV: its first launch shape, both formats, bf16 and fp16 activations
        "cuda_mma_gemv": CudaSource("quant_mma_gemv", ("engine/kernels/linear/quant_gemv_mma.cu",), mma.CUDA_SOURCE,
                                    tuple(mma._name(fmt, x_bf16, *mma.VARIANTS[0]) for fmt in ("nvfp4", "fp8")
                                          for x_bf16 in (True, False)),
                                    # sm80 and sm89 show it needs sm90 (sm75 would add 1.4 s of CPU to CI)
                                    targets=(70, 80, 89, 90)),
    }


def try_compile(lib_path: str, source: CudaSource, capability: int) -> tuple[bool, str]:
    """(compiled, the first line of NVRTC's or ptxas's error)."""
    try:
        compile_cubin(lib_path, source.text, capability, source.names)
    except NvrtcError as error:
        lines = [line for line in str(error).splitlines() if "error" in line.lower()] or str(error).splitlines()
        return False, lines[0].strip()[:300]
    return True, ""


def version(lib_path: str) -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    ctypes.CDLL(lib_path).nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"
